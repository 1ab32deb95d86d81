"""TensorBoard scalars of a run, written while it trains, into ``RUN/tensorboard/``.

The supervisor hands this mirror every event of its session (after THE fold has seen it) and
every telemetry sample; nothing here reads the files again. Tags:

- ``train/loss``, ``train/loss_avg``, ``train/grad_norm``, ``train/lr`` (several optimizers:
  ``train/lr/<name>``, ``train/grad_norm/<name>``), ``train/skipped``, and each of the task's
  train metrics as ``train/<metric>``;
- ``throughput/samples_per_s``, ``throughput/tokens_per_s``, ``throughput/mfu``,
  ``throughput/step_time_ms``; ``memory/rank<i>/allocated_gib`` and ``.../peak_gib``;
- ``eval/<metric>`` for every eval metric (a named split's as ``eval/<split>/<metric>``);
- ``gpu<i>/util_percent``, ``gpu<i>/memory_used_gib``, ``gpu<i>/temperature_c``,
  ``gpu<i>/power_w``, ``host/cpu_percent``, ``host/ram_used_gib``: telemetry, at its own wall
  time, on the step the run had reached then (from the last step event and the step time);
- text: ``profile`` (the resolved run.toml) and ``start`` (the start event's settings).

Beside them, in ``RUN/tensorboard/hparams/``, the HParams tab's session of the run: its
profile's keys against its final train loss and eval metrics (:mod:`.hparams`).

A ``start`` event (a launch, a resume, a torchrun restart) writes TensorBoard's purge mark
(a ``SessionLog.START`` at ``start_step + 1``): a reader drops what an earlier session wrote
past the checkpoint this one starts from, so a resumed run continues one curve without
duplicate or backward steps. Each session writes a file of its own; the newest is read last.

Written with the tensorboard package's own protobufs (what ``torch.utils.tensorboard`` writes
with) in TFRecord framing made here (:func:`_record`; the package keeps its CRC-32C in a stub
whose import brings numpy and fsspec into the supervisor: 0.3 s of CPU and some 20 MB for two
small functions), synchronously and one whole record per append
(``diskfull.append_whole``), because its asynchronous writer thread dies on the first failed
write: on a full disk a record is dropped and counted, none is torn, and writing goes on when
there is room. tensorboardX is not used: its writer imports torch where torch is installed,
and the supervisor must not. The package is optional (extra ``tensorboard``); without it a
launch says so in one line and the run trains as before.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from .. import diskfull
from . import hparams, scalars

DIR = "tensorboard"
HPARAMS_DIR = "hparams"  # under DIR: the HParams tab's run (results/hparams.py)
INSTALL_HINT = "pip install 'gpu-console[tensorboard]'"
_NUM = (int, float)


def available() -> bool:
    """Whether the tensorboard package can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        return False


def off_note() -> str:
    return (
        f"TensorBoard: off, the tensorboard package is not installed ({INSTALL_HINT}; "
        "[logging] tensorboard = false silences this)"
    )


def _number(v: Any) -> bool:
    return type(v) in _NUM


class TensorBoardMirror:
    """One session's TensorBoard file. Every method may raise (the supervisor turns the mirror
    off on the first unexpected error); a full disk only drops records (:attr:`dropped`)."""

    def __init__(self, run_dir: Path, profile_text: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self.dir = Path(run_dir) / DIR
        self.profile_text = profile_text
        self.telemetry_skipped = 0  # samples with no step of their own left (see sample())
        self._curves = _EventFile(self.dir, event_pb2)
        self._hparams = _EventFile(self.dir / HPARAMS_DIR, event_pb2)
        self._train_loss: tuple[int, float, dict[str, float]] | None = None  # newest, unwritten
        self._started = False  # a start event seen: until then a sample has no step
        self._step = 0  # the newest step of a step event (or the start's step)
        self._step_t: float | None = None
        self._step_time: float | None = None
        self._interval: int | None = None  # steps between the last two step events
        self._max_steps: int | None = None
        self._telemetry_step = -1  # the newest step a sample was written at
        self._texts = False

    @property
    def dropped(self) -> int:
        """Records a full disk kept out."""
        return self._curves.dropped + self._hparams.dropped

    @property
    def path(self) -> Path | None:
        return self._curves.path

    @property
    def hparams_path(self) -> Path | None:
        return self._hparams.path

    # -- what the supervisor feeds -------------------------------------------------------
    def event(self, e: dict[str, Any]) -> None:
        kind, t = e.get("kind"), e.get("t")
        t = float(t) if _number(t) else time.time()
        if kind == "step" and type(e.get("step")) is int:
            self._step_event(e, t)
        elif kind == "eval" and type(e.get("step")) is int:
            self._scalars(e["step"], t, scalars.of_eval(e))
            self._final(e["step"], t, hparams.final_eval(e))
        elif kind == "start":
            self._start(e, t)

    def sample(self, s: dict[str, Any]) -> None:
        """One telemetry sample, on the step the run had reached at its time.

        Each sample takes a step of its own, never an earlier one, and never one past the
        next logged step's (a step time guessed across an eval or a checkpoint would run
        ahead): TensorBoard's server keeps one point per step and tag, and drops the points
        after a step that comes again. A sample with no such step left (a long eval, a
        step slower than the sampling) is left out; ``telemetry.jsonl`` keeps it. Before
        the session's start event there is no step yet: its start-up samples are left out.
        """
        t = s.get("t")
        if not _number(t) or not self._started:
            return
        step = max(self._step_at(float(t)), self._telemetry_step + 1)
        if step > self._step_limit():
            self.telemetry_skipped += 1
            return
        values = scalars.of_sample(s)
        self._telemetry_step = step
        self._scalars(step, float(t), values)

    def close(self) -> None:
        try:
            if self._train_loss is not None:  # the session's last train loss, final
                self._final(*self._train_loss)
        finally:
            self._curves.close()
            self._hparams.close()

    # -- events --------------------------------------------------------------------------
    def _start(self, e: dict[str, Any], t: float) -> None:
        step = e.get("start_step") if type(e.get("start_step")) is int else 0
        self._started = True
        self._step, self._step_t, self._step_time, self._interval = step, None, None, None
        self._telemetry_step = step  # the purge mark is at step + 1: samples from there
        self._max_steps = e.get("max_steps") if type(e.get("max_steps")) is int else None
        self._train_loss = None
        ev = self._event_pb2
        # What an earlier session (or attempt) wrote past this start's checkpoint goes.
        for file in (self._curves, self._hparams):
            file.write(
                ev.Event(
                    wall_time=t,
                    step=step + 1,
                    session_log=ev.SessionLog(status=ev.SessionLog.START),
                )
            )
        if not self._texts:  # the first start of this session: what it runs
            self._texts = True
            self._text("profile", step, t, _code_block(self.profile_text))
            summary = hparams.session_start(hparams.flatten(self.profile_text, e), t)
            self._hparams.write(ev.Event(wall_time=t, step=step, summary=summary))
        self._text("start", step, t, _settings_table(e))

    def _step_event(self, e: dict[str, Any], t: float) -> None:
        step = e["step"]
        values = scalars.of_step(e)
        self._scalars(step, t, values)
        if loss := hparams.final_train_loss(e):
            self._train_loss = (step, t, loss)
        if step > self._step:
            self._interval = step - self._step
        self._step, self._step_t = step, t
        if _number(e.get("step_time_s")) and e["step_time_s"] > 0:
            self._step_time = float(e["step_time_s"])

    def _step_at(self, t: float) -> int:
        """The step the run had reached at wall time ``t``: the last step event's, moved on
        at the step time it reported (telemetry is sampled between log steps)."""
        step = self._step
        if self._step_t is not None and self._step_time and t > self._step_t:
            step += int((t - self._step_t) / self._step_time)
        return min(step, self._step_limit())

    def _step_limit(self) -> int:
        """The last step a sample may take: before the next logged step (its interval as the
        last one's), or the run's last step."""
        limit = self._step + (self._interval - 1 if self._interval else 0)
        return min(limit, self._max_steps) if self._max_steps else limit

    # -- records -------------------------------------------------------------------------
    def _scalars(self, step: int, t: float, values: dict[str, Any]) -> None:
        sp = self._summary_pb2
        kept = [
            sp.Summary.Value(tag=tag, simple_value=float(v))
            for tag, v in values.items()
            if _number(v) and type(v) is not bool
        ]
        if kept:
            self._curves.write(
                self._event_pb2.Event(wall_time=t, step=step, summary=sp.Summary(value=kept))
            )

    def _final(self, step: int, t: float, values: dict[str, float]) -> None:
        """The HParams tab's metrics: the eval's, with the newest train loss beside them."""
        if self._train_loss is not None:
            values = {**self._train_loss[2], **values}
        sp = self._summary_pb2
        kept = [sp.Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()]
        if kept:
            self._hparams.write(
                self._event_pb2.Event(wall_time=t, step=step, summary=sp.Summary(value=kept))
            )
        self._train_loss = None

    def _text(self, tag: str, step: int, t: float, markdown: str) -> None:
        summary = text_summary(tag, markdown)
        self._curves.write(self._event_pb2.Event(wall_time=t, step=step, summary=summary))


class _EventFile:
    """One session's event file in one directory (a TensorBoard run), opened at its first
    record; a full disk only drops records (:attr:`dropped`)."""

    def __init__(self, directory: Path, event_pb2) -> None:
        self.dir = directory
        self._event_pb2 = event_pb2
        self.dropped = 0
        self.path: Path | None = None
        self._fd: int | None = None

    def write(self, event) -> None:
        try:
            if self._fd is None:
                self._open(event.wall_time or time.time())
            assert self._fd is not None
            diskfull.append_whole(self._fd, _record(event.SerializeToString()))
        except OSError as e:
            if diskfull.classify(e, self.dir) is None:
                raise
            self.dropped += 1  # no room now: this record goes, the next one tries again

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self, t: float) -> None:
        """This session's file, named as TensorBoard names its own: a reader takes a
        directory's files in name order, so the session's first event time comes first.
        It starts with its version record (a reader purges by START marks only in files
        that have it), or it is not kept: a full disk then leaves no file, and the next
        record tries again."""
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = f"events.out.tfevents.{int(t):010d}.{socket.gethostname()}.{os.getpid()}"
        n = 0
        while (self.dir / f"{stem}.{n}").exists():  # never append to another session's file
            n += 1
        path = self.dir / f"{stem}.{n}"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        version = self._event_pb2.Event(wall_time=t, file_version="brain.Event:2")
        try:
            diskfull.append_whole(fd, _record(version.SerializeToString()))
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self.path = fd, path


def _record(data: bytes) -> bytes:
    """TFRecord framing: the length, its masked CRC-32C, the data, the data's masked CRC-32C."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """CRC-32C of ``data``, masked as TFRecord masks it (rotated right by 15, plus a constant)."""
    crc = 0xFFFFFFFF
    table = _CRC32C
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def text_summary(tag: str, markdown: str):
    """A text plugin summary of one string (what the package's ``text_pb`` makes, without
    its numpy)."""
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.text import metadata

    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        string_val=[markdown.encode()],
    )
    meta = metadata.create_summary_metadata(display_name=None, description=None)
    return summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)]
    )


def _code_block(text: str) -> str:
    """Markdown that TensorBoard's text tab shows verbatim (an indented code block)."""
    return "\n".join("    " + line for line in text.splitlines())


SETTINGS = (
    "task", "params", "world_size", "device_type", "precision", "strategy", "global_batch",
    "optimizer", "compile", "activation_checkpointing", "start_step", "max_steps",
    "resumed_from", "restart",
)  # fmt: skip


def _settings_table(e: dict[str, Any]) -> str:
    rows = ["| setting | value |", "| --- | --- |"]
    for key in SETTINGS:
        if key in e and e[key] is not None:
            rows.append(f"| {key} | {_cell(e[key])} |")
    versions = e.get("versions")
    if isinstance(versions, dict):
        rows.extend(f"| {k} | {_cell(v)} |" for k, v in versions.items() if v is not None)
    return "\n".join(rows)


def _cell(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return str(v).replace("|", "\\|").replace("\n", " ")
