"""Write the varlen GPU session's cases (varlen.jsonl beside this file) as a worker cases file.

    python varlen_cases.py cases.json
    python -m torch.distributed.run --nproc-per-node 2 -m ringbench.worker --cases cases.json --results varlen.jsonl

2 x H200, torch-flash, bf16, Llama-3-8B attention (32/8 heads, head dim 128), fwd_bwd: the
three varlen variants verified at 16k on lognormal documents (causal and not), llama3_varlen on
empty and one-token documents, zigzag_varlen with empty documents; then timed at 64k with one
document (against batch zigzag) and with 12 lognormal documents (mean 8k).
"""
import json, sys
from ringbench.spec import CaseSpec, default_fields, resolve, resolve_docs, validate
def case(task, variant, **kw):
    f = {"task": task, "variant": variant, **default_fields("cuda", 2), "kernel": "torch-flash"}
    f.update(kw)
    s = resolve_docs(CaseSpec(**f)); validate(s, visible_gpus=2); return resolve(s).to_dict()
cases = []
for v in ("ring_varlen", "zigzag_varlen", "llama3_varlen"):
    for causal in (True, False):
        cases.append(case("verify", v, seqlen=16384, doc_dist="lognormal:mean=4k,sigma=1", causal=causal))
cases.append(case("verify", "llama3_varlen", seqlen=64, docs="0,1,15,0,1,1,30,0,16"))
cases.append(case("verify", "llama3_varlen", seqlen=64, docs="0,1,15,0,1,1,30,0,16", causal=False))
cases.append(case("verify", "zigzag_varlen", seqlen=4096, docs="0,1024,0,3072", heads_k_stride=0))
for v in ("zigzag", "ring_varlen", "zigzag_varlen", "llama3_varlen"):
    docs = {} if v == "zigzag" else {"docs": "65536"}
    cases.append(case("run", v, seqlen=65536, **docs))
for v in ("ring_varlen", "zigzag_varlen", "llama3_varlen"):
    cases.append(case("run", v, seqlen=65536, doc_dist="lognormal:mean=8k,sigma=1"))
json.dump({"run_id": "varlen-gpu", "cases": cases}, open(sys.argv[1], "w"))
print(len(cases), "cases")
