"""What the rank opens around a case and the engines read: verify's observation of kernel calls
(``observe``), the profile's spans (``timeline``) and one-device emulation (``emulation``)."""
