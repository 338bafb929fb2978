"""TRL's own GRPO test file run against grpo_jax: its `from trl import GRPOConfig, GRPOTrainer` changed to
grpo_jax, nothing else, on local stand-ins for its Hub ids; a deterministic sample of its tests, counted.

    git clone --bare https://github.com/huggingface/trl /tmp/trl.git
    python benchmarks/trl_port/run.py --trl-git /tmp/trl.git --every 8 --out /tmp/trl_port

writes OUT/port/ (the test file, TRL's testing utils with TRL 1.16 fallbacks, a conftest that serves the stand-ins),
OUT/hf/hub (a Hugging Face cache holding the tiny models: TRL's tiny-model configs, `tests/trl_tools.qwen_tokenizer`'s
~500-token byte-level BPE with Qwen2.5's chat template standing in for Qwen's tokenizer), OUT/data (the
`trl-internal-testing/zen` configurations as `datasets` folders with its columns), then runs every Nth test by
collection order (`--match`: those whose id holds a string) in chunks of `--chunk` tests, one pytest process each,
whose junit files are kept (a stopped run keeps its finished chunks; the same command continues), and writes
OUT/summary.json (passed / failed / skipped, the failures grouped by their first line, each test's outcome).
`--trl` runs the same sample against TRL itself (OUT/summary_trl.json): the denominator, the tests TRL passes here.
Needs torch, trl and datasets; not run in CI (hours for the whole file on a CPU). Measured samples: results.md.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORG = "trl-internal-testing"
# TRL's scripts/generate_tiny_models configs (hidden 8, 4 heads, 2 kv heads, 2 layers, intermediate 32); the vocab is
# the stand-in tokenizer's
TINY = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2Config", "Qwen2ForSequenceClassification", {"num_labels": 1}),
    "tiny-Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "tiny-Qwen3ForSequenceClassification": ("Qwen3Config", "Qwen3ForSequenceClassification", {"num_labels": 1}),
    "tiny-Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                 {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                  "head_dim": 128}),
    "tiny-LlamaForCausalLM-3.2": ("LlamaConfig", "LlamaForCausalLM", {}),
    "tiny-Gemma2ForCausalLM": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "tiny-LlamaForSequenceClassification-3.2": ("LlamaConfig", "LlamaForSequenceClassification", {"num_labels": 1}),
    "tiny-MistralForCausalLM-0.2": ("MistralConfig", "MistralForCausalLM", {}),
    # families grpo_jax does not implement: TRL trains them, so they count in the denominator
    "tiny-Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM", {}),
    "tiny-Glm4MoeForCausalLM": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                                         "first_k_dense_replace": 1}),
    "tiny-GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                                     "head_dim": 2}),
}
SWAP = ("from trl import GRPOConfig, GRPOTrainer", "from grpo_jax import GRPOConfig, GRPOTrainer")

CONFTEST = '''"""Stand-ins for the Hub: the tiny models in a local Hugging Face cache, zen as local datasets folders."""
import os

os.environ["HF_HUB_CACHE"] = {hub!r}
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datasets  # noqa: E402

_load_dataset = datasets.load_dataset
DATA = {data!r}


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if not str(path).startswith("trl-internal-testing/"):
        return _load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
    folder = os.path.join(DATA, str(path).split("/")[1], name or "default")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no local stand-in for {{path}} {{name}}")
    dataset = datasets.load_from_disk(folder)
    if split is not None:
        dataset = dataset[split]
        return dataset.to_iterable_dataset() if streaming else dataset
    return datasets.IterableDatasetDict({{k: v.to_iterable_dataset() for k, v in dataset.items()}}) if streaming \\
        else dataset


datasets.load_dataset = load_dataset
'''

# TRL's GRPOConfig defaults to bf16, which transformers refuses on a CPU unless use_cpu is set (TRL's CI has a GPU)
TRL_ON_CPU = '''

import trl  # noqa: E402

_post_init = trl.GRPOConfig.__post_init__


def _on_cpu(self):
    self.use_cpu = True
    _post_init(self)


trl.GRPOConfig.__post_init__ = _on_cpu
'''


def testing_utils(source: str) -> str:
    """TRL's testing utils with each `trl.import_utils` name it imports falling back to False where TRL 1.16 lacks
    it."""
    block = re.search(r"from trl\.import_utils import \((.*?)\)\n", source, re.S)
    names = [n.strip() for n in block.group(1).split(",") if n.strip()]
    fallback = "import trl.import_utils as _trl_import_utils\n" + "".join(
        f"{n} = getattr(_trl_import_utils, {n!r}, lambda: False)\n" for n in names)
    return source.replace(block.group(0), fallback)


def zen_lines() -> list[str]:
    import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]


def build_data(out: Path) -> None:
    """zen's configurations used by the test file: prompt-only, standard and conversational, train 17 / test 2."""
    import datasets
    lines = zen_lines()
    prompts = [" ".join(line.split()[:max(1, len(line.split()) // 2)]) for line in lines]
    for name, column in (("standard_prompt_only", lambda p: p),
                         ("conversational_prompt_only", lambda p: [{"role": "user", "content": p}])):
        rows = [{"prompt": column(p)} for p in prompts]
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:17]),
                              "test": datasets.Dataset.from_list(rows[17:19])}).save_to_disk(
            str(out / "zen" / name))


def build_models(hub: Path) -> None:
    """Each stand-in as a cached snapshot (refs/main -> snapshots/HASH), as `hf download` leaves it."""
    import torch
    import transformers
    sys.path.insert(0, str(ROOT / "tests"))
    from trl_tools import qwen_tokenizer

    for i, (name, (config_cls, model_cls, extra)) in enumerate(MODELS.items()):
        repo = hub / f"models--{ORG}--{name}"
        if (repo / "refs" / "main").is_file():  # built by an earlier run
            continue
        tokenizer = qwen_tokenizer()
        if "Llama" in name:  # Llama 3.2's padding token, which TRL's tests set by name
            tokenizer.add_special_tokens({"additional_special_tokens": ["<|finetune_right_pad_id|>"]})
        commit = f"{i + 1:040x}"
        folder = repo / "snapshots" / commit
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(i)
        config = getattr(transformers, config_cls)(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                   eos_token_id=tokenizer.eos_token_id, **TINY, **extra)
        getattr(transformers, model_cls)(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)  # last: a stopped build is rebuilt


def build(out: Path, trl_git: str) -> Path:
    def show(path):
        return subprocess.run(["git", f"--git-dir={trl_git}", "show", f"HEAD:{path}"], check=True,
                              capture_output=True, text=True).stdout

    port = out / "port"
    port.mkdir(parents=True, exist_ok=True)
    test = show("tests/test_grpo_trainer.py")
    if SWAP[0] not in test:
        raise SystemExit(f"{SWAP[0]!r} not in the test file: the snapshot changed its imports")
    (port / "test_grpo_trainer.py").write_text(test.replace(SWAP[0], SWAP[1]))
    (port / "testing_utils.py").write_text(testing_utils(show("tests/testing_utils.py")))
    (port / "__init__.py").write_text("")
    hub, data = out / "hf" / "hub", out / "data"
    (port / "conftest.py").write_text(CONFTEST.format(hub=str(hub), data=str(data)))
    build_models(hub)
    if not data.is_dir():
        build_data(data)
    return port


def summarize(reports: list[Path], sample: str, collected: int, run: int) -> dict:
    """passed / failed / skipped over the chunks' junit files, the failures grouped by their first line, and each
    test's outcome (its failure's first line, or passed / skipped)."""
    outcomes, reasons, tests = collections.Counter(), collections.Counter(), {}
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            name = case.get("name")
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            if failed is not None:
                outcomes["failed"] += 1
                reason = (failed.get("message") or "").split("\n")[0][:160]
                reasons[reason] += 1
                tests[name] = "failed: " + reason
            elif case.find("skipped") is not None:
                outcomes["skipped"] += 1
                tests[name] = "skipped: " + (case.find("skipped").get("message") or "")[:100]
            else:
                outcomes["passed"] += 1
                tests[name] = "passed"
    return {"collected": collected, "sample": sample, "run": run, **outcomes,
            "failure_reasons": reasons.most_common(), "tests": tests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-git", required=True,
                        help="a git directory of huggingface/trl (`git clone --bare https://github.com/huggingface/trl`)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/trl_port"))
    parser.add_argument("--every", type=int, default=8, help="run tests 0, N, 2N, ... of the collection order")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--match", default=None, help="only the sampled tests whose id contains this string")
    parser.add_argument("--chunk", type=int, default=4,
                        help="tests per pytest process: each chunk's junit file is kept, so a run stopped midway "
                             "keeps its finished chunks and a rerun with the same sample continues after them")
    parser.add_argument("--trl", action="store_true",
                        help="the same sample against TRL itself (the file as TRL ships it): the denominator")
    args = parser.parse_args()
    port = build(args.out, args.trl_git)
    if args.trl:
        source = port / "test_grpo_trainer.py"
        port = args.out / "port_trl"
        shutil.copytree(args.out / "port", port, dirs_exist_ok=True)
        (port / "test_grpo_trainer.py").write_text(source.read_text().replace(SWAP[1], SWAP[0]))
        with open(port / "conftest.py", "a") as f:
            f.write(TRL_ON_CPU)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(args.out)])}
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                                "-p", "no:cacheprovider", str(port / "test_grpo_trainer.py")],
                               capture_output=True, text=True, env=env, cwd=args.out).stdout
    ids = [line for line in collected.splitlines() if "::" in line]
    sample = [i for i in ids[args.offset::args.every] if args.match is None or args.match in i]
    label = f"every {args.every}th from {args.offset}" + (f" matching {args.match!r}" if args.match else "") + \
        (" (TRL itself)" if args.trl else "")
    print(f"{len(ids)} tests collected; running {len(sample)} ({label})", flush=True)
    reports = args.out / ("junit_trl" if args.trl else "junit")
    reports.mkdir(exist_ok=True)
    done = []
    for start in range(0, len(sample), args.chunk):
        chunk = sample[start:start + args.chunk]
        report = reports / f"{hashlib.sha1(chr(10).join(chunk).encode()).hexdigest()[:16]}.xml"
        if not report.is_file():  # a chunk finished by an earlier run of the same sample is kept
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                            f"--junitxml={report}.partial", *chunk], env=env, cwd=args.out)
            if Path(f"{report}.partial").is_file():
                Path(f"{report}.partial").replace(report)
        if report.is_file():
            done.append(report)
    summary = summarize(done, label, len(ids), len(sample))
    (args.out / ("summary_trl.json" if args.trl else "summary.json")).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "tests"}, indent=1))
    ours, theirs = args.out / "summary.json", args.out / "summary_trl.json"
    if ours.is_file() and theirs.is_file():
        print(json.dumps(compare(json.loads(ours.read_text()), json.loads(theirs.read_text())), indent=1))


def compare(ours: dict, theirs: dict) -> dict:
    """Of the tests TRL passes itself (the denominator), how many pass with grpo_jax, and each one that does not."""
    passed = [t for t, outcome in theirs["tests"].items() if outcome == "passed" and t in ours["tests"]]
    return {"trl_passes": len(passed), "grpo_jax_passes_of_those": sum(ours["tests"][t] == "passed" for t in passed),
            "not_passing": {t: ours["tests"][t] for t in passed if ours["tests"][t] != "passed"},
            "passing_where_trl_does_not": [t for t, o in ours["tests"].items()
                                           if o == "passed" and theirs["tests"].get(t, "passed") != "passed"]}


if __name__ == "__main__":
    main()
