"""One engine process for the tier tests: serve prompts with the given tiers, save the outputs,
close (flushing pending writes) and exit.

    python tests/tiers_child.py SPEC.json OUT.pt
SPEC: {"model", "prompts", "max_tokens", "engine": {EngineConfig options}, "fsize_limit": bytes|null}
"""

import json
import logging
import resource
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv.engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if spec.get("fsize_limit"):            # a disk that fills up: writes past the limit fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    llm = LLM(spec["model"], **spec["engine"])
    llm.engine.record_logits = True
    out = {"ids": [], "logits": [], "cached": []}
    for prompt in spec["prompts"]:
        seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=spec["max_tokens"]))
        while llm.engine.has_unfinished():
            llm.engine.step()
        out["ids"].append(seq.output_ids)
        out["logits"].append(torch.stack(seq.step_logits))
        out["cached"].append(seq.num_cached_tokens)
    llm.close()
    out["stats"] = llm.engine.cache_stats()
    if spec.get("fsize_limit"):
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
