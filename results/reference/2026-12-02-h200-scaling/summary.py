"""One line per run record: the figures the strong-scaling notes quote."""
import json
import sys

for line in open(sys.argv[1]):
    r = json.loads(line)
    s = r["spec"]
    prof = (r.get("profile") or {}).get("per_rank") or []
    gap = max((p.get("host_gap_ms") or 0) for p in prof) if prof else None
    print(s["variant"], r.get("kernel"), "W", s["world_size"], "S", s["seqlen"], "emu", r.get("emulated"), r["status"],
          "graph", r.get("cuda_graph"), repr(r.get("cuda_graph_note")),
          "ms", r.get("time_ms") and round(r["time_ms"], 3),
          "p20-p80", r.get("time_ms_p20") and (round(r["time_ms_p20"], 3), round(r["time_ms_p80"], 3)),
          "tflops", r.get("tflops_per_gpu") and round(r["tflops_per_gpu"], 1),
          "eff", r.get("efficiency") and round(r["efficiency"], 4),
          "bound", r.get("efficiency_bound") and round(r["efficiency_bound"], 4),
          "max host gap ms", gap and round(gap, 3), r.get("reason") or "")
