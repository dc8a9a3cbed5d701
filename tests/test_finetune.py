"""The fine-tune path end to end, on tiny Hugging Face models built here (tests/hf_dirs.py: a Llama with
an untied head and GQA, a Qwen2 with a tied head and q/k/v biases, a GPT-2), saved in several shards:

    tokenizer.json (trained here on the built-in corpus) -> python -m train.prepare
    -> python -m train --init-from DIR --stage 3 --nproc 2 -> python -m zerofunc.consolidate --hf
    -> AutoModelForCausalLM.from_pretrained

Two checks on the way, both in fp32 within 1e-5 (BOUND): the trainer's first logged loss is Hugging
Face's own loss on the same first global batch, and the exported model's logits are the trainer's. And
the README's fine-tune commands run as written.

BOUND is sized, not derived: what differs in a correct run is only the order of the same fp32 operations
(attention and matmul kernels, the chunked head of zerofunc/lm_head.py), measured 2026-11-26 at 0, 0 and
4.8e-7 (gpt2) for the first loss and 0, 0 and 6e-8 for the logits. A weight rounded through bf16 on its way
in moves the first loss by 3.6e-5 to 5.6e-5, on its way out the logits by 1.7e-3 to 2.1e-3 (tests/plants.py:
load_through_bf16, export_through_bf16), so 1e-5 lies 20x above the first and 3.6x below the second.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.hf_dirs import FAMILIES, save_hf_dir

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SEQ, MICRO, RANKS = 16, 2, 2
BOUND = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A directory of documents from the built-in corpus and a byte-level BPE tokenizer trained on them."""
    from tests.tokenizer import train_tokenizer
    from train.data import stdlib_files

    root = tmp_path_factory.mktemp("corpus")
    docs = root / "docs"
    docs.mkdir()
    for i, path in enumerate(stdlib_files()[:60]):
        (docs / f"{i:03d}.py.txt").write_text(path.read_text(encoding="utf-8", errors="replace"))
    tokenizer = root / "tokenizer.json"
    train_tokenizer(tokenizer, [p.read_text() for p in sorted(docs.iterdir())], vocab_size=300)
    return docs, tokenizer


def first_global_batch(data: Path) -> torch.Tensor:
    """Step 1's global batch, every rank's rows in rank order, as windows of SEQ + 1 tokens."""
    from train.data import load_corpus, rank_batch

    corpus = load_corpus(str(data), SEQ)
    parts = [rank_batch(corpus, 1, MICRO, RANKS, r, SEQ, 0) for r in range(RANKS)]
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y, _ in parts])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_prepare_train_export_load(tmp_path, corpus, family):
    from train.cli import main as train
    from train.prepare import main as prepare
    from zerofunc.checkpoint_files import consolidated
    from zerofunc.consolidate import main as consolidate
    from zerofunc.models import build_model, model_config

    docs, tokenizer = corpus
    model_dir = save_hf_dir(family, tmp_path / "model", vocab=300)
    data, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "export"
    assert prepare(["--tokenizer", str(tokenizer), "--out", str(data), str(docs)]) == 0
    assert train(["--init-from", str(model_dir), "--data", str(data), "--stage", "3", "--nproc", str(RANKS),
                  "--steps", "2", "--seq", str(SEQ), "--micro-batch", str(MICRO), "--save-every", "2",
                  "--out", str(run)]) == 0

    # the first logged loss is Hugging Face's own on the same global batch (labels = inputs: it shifts them)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    rows = first_global_batch(data)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = reference(input_ids=rows, labels=rows).loss.item()
    assert abs(first - hf_loss) <= BOUND, (family, first, hf_loss)

    assert consolidate([str(run), str(out), "--hf", "--max-shard-size", "30KB", "--tokenizer", str(tokenizer)]) == 0
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if family != "llama":  # tied heads stay tied
        assert exported.get_output_embeddings().weight.data_ptr() == exported.get_input_embeddings().weight.data_ptr()

    ours = build_model(model_config(str(model_dir / "config.json"))).eval()
    ours.load_state_dict(consolidated(run), strict=False)  # a tied head is the embedding itself
    with torch.no_grad():
        theirs = exported.eval()(input_ids=rows).logits
        mine = ours(rows)
    diff = (theirs - mine).abs().max().item()
    assert diff <= BOUND, f"{family}: the exported model's logits differ from the trainer's by {diff:.2e}"


def readme_finetune_commands() -> list[str]:
    """The commands of the README's fine-tune section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Fine-tune"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_finetune_trains_at_a_fine_tuning_rate_for_the_steps_it_names(tmp_path):
    """The README's train line, parsed by the trainer, fine-tunes at a rate for pretrained weights at every
    step (1e-5 to 1e-4, as Hugging Face's and DeepSpeed's fine-tunes do), not the from-scratch default of
    1e-3 that --init-from leaves alone; and names its step count. So does docs/TRAIN.md's warm-up config."""
    from train.cli import parse
    from zerofunc.config import parse as parse_config

    model = save_hf_dir("qwen2", tmp_path / "model", vocab=300)
    line = next(c for c in readme_finetune_commands() if shlex.split(c)[:3] == ["python", "-m", "train"])
    argv = [a.replace("$MODEL", str(model)) for a in shlex.split(line)[3:]]
    args = parse(argv)
    assert args.init_from == str(model) and "--steps" in argv
    rates = [args.config.lr(step) for step in range(1, args.steps + 1)]
    assert 1e-5 <= max(rates) <= 1e-4, max(rates)
    train_md = (ROOT / "docs" / "TRAIN.md").read_text()
    warm_up = json.loads(re.search(r"```json\n(.*?)```", train_md[train_md.index("**Learning rate.**"):], re.S).group(1))
    lr = args.config.optimizer.lr  # "rises linearly from 0 to --lr over 30 steps"
    config = parse_config(warm_up | {"optimizer": {"params": {"lr": lr}}}, 2)
    assert (config.lr(1), config.lr(16), config.lr(31)) == (0, pytest.approx(lr / 2), lr)


@pytest.mark.slow
def test_the_readme_finetune_commands_run_as_written(tmp_path, corpus, monkeypatch):
    """On a tiny Qwen2 in place of the real model: MODEL and the text directory point at it, and the
    train command gets a short run appended (--steps 3 --seq 16 --eval-every 2 --eval-batches 1) for time."""
    from train.cli import main as train
    from train.prepare import main as prepare
    from zerofunc.consolidate import main as consolidate
    from zerofunc.plan.__main__ import main as plan

    docs, tokenizer = corpus
    model = save_hf_dir("qwen2", tmp_path / "model", vocab=300)
    (model / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_texts").symlink_to(docs)
    tools = {"zerofunc.plan": plan, "train.prepare": prepare, "train": train, "zerofunc.consolidate": consolidate}
    commands = readme_finetune_commands()
    assert [shlex.split(c)[2] for c in commands if c.startswith("python -m")] == list(tools), commands
    env = {}
    for line in commands:
        if "=" in line.split()[0]:  # MODEL=path/to/...
            name = line.split("=")[0]
            env[name] = str(model)
            continue
        argv = [env.get(a[1:], a) if a.startswith("$") else a for a in shlex.split(line.split("#")[0])]
        argv = [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], a) for a in argv]
        tool = argv[2]
        if tool == "train":
            argv += ["--steps", "3", "--seq", "16", "--eval-every", "2", "--eval-batches", "1"]
        assert tools[tool](argv[3:]) == 0, line
    exported = [p for p in tmp_path.rglob("config.json") if p.parent != model]
    assert exported, "the export wrote no model directory"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported[0].parent)
    assert loaded.config.model_type == "qwen2"
