"""Compile one RNGD graph with given CompilerConfig fields (how base32, mus16_32, t32_preset and
mus16_512 were made). Run in .venv-rngd from the repository root:

    .venv-rngd/bin/python bench/results/rngd-search-bound-2026-12-03-epyc/preset.py \
        prefill_layer_t32 '{"max_num_unique_shapes": 16}'
"""

import argparse
import json
import sys

from furiosa.torch import config
from furiosa.torch._C.config.compiler import ProgressMode

from rngd_pd.devices import rngd_graphs

ENUMS = {"tactic_hint": config.TacticHintConfig, "tactic_sorting_policy": config.TacticSortingPolicy}


def main() -> None:
    name, fields = sys.argv[1], json.loads(sys.argv[2])

    def compiler_config(tactic_hint: object = None, max_unique_shapes: object = None) -> object:
        kw = {k: getattr(ENUMS[k], v) if k in ENUMS else v for k, v in fields.items()}
        return config.CompilerConfig(progress_mode=ProgressMode.Json, **kw)

    rngd_graphs.compiler_config = compiler_config
    args = argparse.Namespace(dtype="bf16", kv_dtype="bf16", stage="compile", no_cache=True,
                              tactic_hint=None, max_unique_shapes=None)
    row = rngd_graphs.compile_one(rngd_graphs._spec_by_name(name), args)
    print(json.dumps({**row, "preset": fields}), flush=True)


if __name__ == "__main__":
    main()
