"""What a case is, with no process and no torch: its fields, the CaseSpec and its checks, option
parsing, scenarios, model configs and the work predicted from its mask. Imported by every other
package of the harness; imports only ``ringbench.errors`` and the variant registry."""
