"""The built-in ``lm`` (issue 22): a GPT-style causal language model on a text's bytes. Its
pieces alone, then on 2 CPU ranks (the harness, tests/harness.py): a text file given as a
setting, the perplexity falls, the samples are shown, ``export`` loads into its model class
with plain torch; FSDP with activation checkpointing trains it too; through real torchrun, a
Ctrl-C and a resume continue bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import events_of
from harness import cut_and_resumed, run_engine
from headless_text import headless_text

from gpu_console.profile import load_profile
from gpu_console.tasks.lm import GPT, LMTask, greedy, read_text, windows


def test_the_default_text_is_pythons_own_help_and_windows_are_consecutive():
    cfg = load_profile("lm").task
    text = read_text(cfg)
    assert len(text) > 100_000 and b"assert" in text
    data = torch.arange(10)
    assert windows(data, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_the_model_is_causal_and_ties_its_output_to_the_byte_table():
    cfg = load_profile("lm", ["task.seq_len=16", "task.d_model=32", "task.n_heads=2"]).task
    torch.manual_seed(0)
    model = LMTask(cfg).build_model().eval()
    assert model.head.weight is model.tok.weight
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256  # a different future
    with torch.no_grad():
        assert torch.equal(model(a)[0, :10], model(b)[0, :10]), "no position sees ahead"
        made = greedy(model, a[0, :5], 20)  # longer than nothing, through a 16-byte window
    assert made.shape == (20,) and made.dtype == torch.long


def test_a_missing_text_file_is_named(tmp_path):
    cfg = load_profile("lm", [f"task.text_file={tmp_path / 'none.txt'}"]).task
    with pytest.raises(FileNotFoundError, match="task.text_file: no such file: .*none.txt"):
        LMTask(cfg).build_datasets()


# A text a small model learns in a few dozen steps: short sentences over and over.
TEXT = "the cat sat on the mat. the dog ate the log. a bird in the hand.\n" * 400


# The profile's model at a quarter of its width (its two blocks kept): what these runs check
# (learning, samples, an exact resume, the export, FSDP's blocks) is the family's, not its
# size's; a rank's step costs a fifth of the default's.
NARROW = ["task.d_model=32", "task.n_heads=2"]


def short(text_file) -> list[str]:
    return ["train.max_steps=40", "train.eval_every=20", "train.warmup_steps=5",
            f"task.text_file={text_file}", "task.sample_bytes=24", "train.log_every=1",
            *NARROW]  # fmt: skip


def test_lm_on_a_text_file_learns_samples_resumes_exactly_and_exports(procs, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    whole_dir = tmp_path / "whole"
    run = run_engine(tmp_path, "lm", *short(text), ranks=2, runs_dir=whole_dir)
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[1]["ppl"] < evals[0]["ppl"] < 256, evals  # below a uniform guess, and falling
    assert evals[0]["ppl"] == pytest.approx(torch.tensor(evals[0]["loss"]).exp().item())
    samples = [e["message"] for e in events_of(run, "log") if "sample @ step" in e["message"]]
    assert [s.split(":")[0] for s in samples] == ["sample @ step 20", "sample @ step 40"]
    assert "sample @ step 40: " in headless_text(run)
    losses = {e["step"]: e["loss"] for e in events_of(run, "step")}

    stop = 20  # an eval's step
    cut = cut_and_resumed(tmp_path, "lm", *short(text), cut_at=stop)
    resumed = {e["step"]: e["loss"] for e in events_of(cut, "step") if e["step"] > stop}
    assert resumed == {s: loss for s, loss in losses.items() if s > stop}

    out = tmp_path / "weights.pt"
    exported = procs.cli("export", str(run), "--out", str(out), "--runs-dir", str(whole_dir))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    model = GPT(load_profile("lm", NARROW).task)
    model.load_state_dict(torch.load(out, weights_only=True))  # plain torch, nothing else


def test_lm_trains_under_fsdp_with_activation_checkpointing(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    fsdp = ["distributed.strategy=fsdp", "train.activation_checkpointing=blocks"]
    run = run_engine(tmp_path, "lm", *short(text), *fsdp, ranks=2)
    start = events_of(run, "start")[0]
    assert start["strategy"] == "fsdp"
    losses = [e["loss"] for e in events_of(run, "step")]
    assert losses[-1] < losses[0]
    assert [e["step"] for e in events_of(run, "eval")] == [20, 40]


def test_the_untrained_model_starts_near_a_uniform_guess():
    # ln 256 = 5.55 for a model that knows nothing of bytes; the tied table's N(0, 1) init
    # gave about 25 (issue 42).
    import math

    from gpu_console.tasks.configs import LMConfig
    from gpu_console.tasks.lm import GPT, VOCAB

    torch.manual_seed(0)
    model = GPT(LMConfig())
    x = torch.randint(0, VOCAB, (8, 64))
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1))
    assert abs(loss.item() - math.log(VOCAB)) < 0.5, loss.item()
