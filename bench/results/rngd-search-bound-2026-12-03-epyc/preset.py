"""Experiment: compile one graph with a given CompilerConfig preset (monkeypatched)."""
import argparse, json, sys
from rngd_pd.devices import rngd_graphs as g
from furiosa.torch import config

preset = json.loads(sys.argv[2])
def cc(tactic_hint=None, max_unique_shapes=None):
    from furiosa.torch._C.config.compiler import ProgressMode
    kw = {"progress_mode": ProgressMode.Json}
    for k, v in preset.items():
        if k == "tactic_hint": v = getattr(config.TacticHintConfig, v)
        if k == "tactic_sorting_policy": v = getattr(config.TacticSortingPolicy, v)
        kw[k] = v
    return config.CompilerConfig(**kw)
g.compiler_config = cc
args = argparse.Namespace(dtype="bf16", kv_dtype="bf16", stage="compile", no_cache=True, tactic_hint=None, max_unique_shapes=None)
row = g.compile_one(g._spec_by_name(sys.argv[1]), args)
row["preset"] = preset
print(json.dumps(row), flush=True)
