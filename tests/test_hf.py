"""The built-in ``hf`` (issue 22): a Hugging Face transformers model from a tiny config,
offline. Its pieces alone, then on 2 CPU ranks (the harness, tests/harness.py): it trains
and its loss falls, ``export`` loads into the transformers class with plain torch, the
classifier learns, a saved model directory with its own tokenizer trains; through real
torchrun, a Ctrl-C and a resume continue bit for bit; and without transformers the profile
fails before launch in one line that says what to install."""

from __future__ import annotations

import pytest
import torch
from conftest import events_of, run_dirs
from conftest import test_env as cli_env
from harness import cut_and_resumed, preload, run_engine

from gpu_console.profile import ProfileError, load_profile
from gpu_console.tasks.hf import HFTask
from gpu_console.tasks.lm import read_text

transformers = pytest.importorskip("transformers")

TINY = ["task.config.n_embd=32", "task.config.n_head=2", "task.config.n_layer=1"]

# What the task imports in every rank (some 3 CPU-s of transformers), imported once by the
# harness's zygote instead: its 2-rank runs' ranks are forked past it.
RANK_IMPORTS = (
    "gpu_console.tasks.hf",
    "transformers",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.tokenization_utils_fast",
)


@pytest.fixture
def preloaded():
    preload(*RANK_IMPORTS)


def test_the_config_table_builds_the_model_and_nested_sets_keep_the_rest_of_it():
    cfg = load_profile("hf", TINY).task
    assert cfg.config["model_type"] == "gpt2" and cfg.config["n_embd"] == 32
    assert cfg.config["vocab_size"] == 256  # kept from the profile's table
    model = HFTask(cfg).build_model()
    assert isinstance(model, transformers.GPT2LMHeadModel)
    assert model.config.n_embd == 32 and model.config.n_layer == 1


def test_config_problems_are_one_line_each(tmp_path):
    with pytest.raises(ProfileError, match=r"task.config: expected a table \(got 3\)"):
        load_profile("hf", ["task.config=3"])
    with pytest.raises(ProfileError, match="task.config: needs model_type"):
        load_profile("hf", ["task.config={n_layer = 1}"])
    with pytest.raises(ProfileError, match=r"--set: n_layer: is not a table"):
        load_profile("hf", ["task.config.n_layer.heads=1"])  # n_layer is a number
    cfg = load_profile("hf", [*TINY, "task.config.vocab_size=100"]).task
    with pytest.raises(ValueError, match="vocabulary needs 256 tokens \\(has 100\\)"):
        HFTask(cfg).build_model()
    cfg = load_profile("hf", [f"task.model={tmp_path / 'none'}"]).task
    with pytest.raises(FileNotFoundError, match="task.model: no such directory"):
        HFTask(cfg).build_model()


def test_the_classifier_tells_the_text_from_the_text_shifted_by_one():
    cfg = load_profile("hf", [*TINY, "task.head=sequence-classification", "task.seq_len=8"]).task
    task = HFTask(cfg)
    model = task.build_model()
    assert isinstance(model, transformers.GPT2ForSequenceClassification)
    train, _ = task.build_datasets()
    seqs, labels = train.tensors
    assert labels[:4].tolist() == [0, 1, 0, 1]
    text = torch.tensor(list(read_text(cfg)[:16]))
    assert torch.equal(seqs[0], text[:8])
    assert torch.equal(seqs[1], (text[8:] + 1) % 256)  # the second window, each byte one up
    out = task.compute(model, (seqs[:4], labels[:4]))
    assert out.loss.ndim == 0 and 0 <= float(out.metrics["accuracy"]) <= 1


SHORT = [
    *TINY,
    "train.max_steps=30",
    "train.eval_every=15",
    "train.log_every=1",
    "train.warmup_steps=3",
    "task.seq_len=32",
    "task.config.n_positions=32",
    "checkpoint.every_steps=15",
]


def test_hf_trains_a_tiny_config_offline_resumes_exactly_and_exports(procs, tmp_path, preloaded):
    whole_dir = tmp_path / "whole"
    run = run_engine(tmp_path, "hf", *SHORT, ranks=2, runs_dir=whole_dir)
    losses = {e["step"]: e["loss"] for e in events_of(run, "step")}
    assert sum(losses[s] for s in range(26, 31)) < sum(losses[s] for s in range(1, 6))
    assert [e["step"] for e in events_of(run, "eval")] == [15, 30]

    stop = 15  # an eval's step
    cut = cut_and_resumed(tmp_path, "hf", *SHORT, cut_at=stop)
    resumed = {e["step"]: e["loss"] for e in events_of(cut, "step") if e["step"] > stop}
    assert resumed == {s: loss for s, loss in losses.items() if s > stop}

    out = tmp_path / "weights.pt"
    exported = procs.cli("export", str(run), "--out", str(out), "--runs-dir", str(whole_dir))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    config = load_profile("hf", [s for s in SHORT if s.startswith("task.")]).task.config
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    model.load_state_dict(torch.load(out, weights_only=True))  # plain torch, nothing else


def test_the_classifier_learns_on_two_ranks(tmp_path, preloaded):
    sets = [*TINY, "task.head=sequence-classification", "train.max_steps=20",
            "train.eval_every=20", "task.seq_len=32", "task.config.n_positions=32"]  # fmt: skip
    (final,) = events_of(run_engine(tmp_path, "hf", *sets, ranks=2), "eval")
    assert final["accuracy"] > 0.9 and final["loss"] < 0.3, final


def test_a_saved_model_directory_trains_through_its_own_tokenizer(tmp_path, preloaded):
    """A model and a word-level tokenizer saved to a directory, as a user's download would
    be: the run loads both with nothing fetched, and the sequences are the tokenizer's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. the dog ate the log.\n" * 300)
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train([str(text)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    saved = tmp_path / "model"
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(saved)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(saved)

    sets = [f"task.model={saved}", f"task.text_file={text}", "task.seq_len=8",
            "train.max_steps=20", "train.eval_every=20", "train.log_every=1"]  # fmt: skip
    run = run_engine(tmp_path, "hf", *sets, ranks=2)
    start = events_of(run, "start")[0]
    assert start["params"] == sum(
        p.numel() for p in transformers.GPT2LMHeadModel(config).parameters()
    )
    losses = [e["loss"] for e in events_of(run, "step")]
    assert losses[-1] < losses[0] < 10, losses  # about ln(13 words), not ln(256 bytes) = 5.5+


def test_without_transformers_the_profile_fails_in_one_line_before_launch(procs, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    # The documented way to make a package unimportable: sys.modules[name] = None.
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    env = cli_env()
    env["PYTHONPATH"] = f"{blocker}:{env.get('PYTHONPATH', '')}"
    runs = tmp_path / "runs"
    result = procs.cli("run", "hf", "--headless", "--devices", "cpu:2", "--runs-dir", str(runs),
                       env=env)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert (
        'task.kind: "hf" needs the transformers package: pip install "gpu-console[hf]"'
        in (lines[0])
    )
    assert not run_dirs(runs) and not runs.exists()
