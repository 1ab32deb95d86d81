"""TensorBoard's HParams tab for a run: its profile's keys against its final metrics.

TensorBoard lists a *session* for each run that holds a ``_hparams_/session_start_info``
summary (the plugin's own tag and protobufs), with the hyperparameters it names, and takes
as the session's metrics the newest value of every scalar tag of that run. So the mirror
writes, into ``RUN/tensorboard/hparams/`` (a TensorBoard run of its own, beside the curves):

- the session start: every scalar key of the resolved ``run.toml``, flattened
  (``train.lr``, ``data.batch_size``, ``train.precision``, ``task.kind``, ...; a list as its
  JSON text), plus what the start event resolved (``run.strategy``, ``run.precision``,
  ``run.world_size``, ``run.global_batch``, ``run.device_type``, ``run.params``);
- the metrics, few and final: ``final/train_loss`` (the newest interval mean) and
  ``final/eval/<metric>`` at each eval, and the train loss again at the session's end. Their
  newest values are the run's final ones once it ended.

No experiment summary is written: TensorBoard then builds the tab from every session's keys
(runs of different tasks keep theirs), with the metrics found in those runs, which are only
the ``final/`` ones. Built from protobufs alone (no numpy: the supervisor imports none).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .. import toml_text

SESSION_START_TAG = "_hparams_/session_start_info"
RESOLVED = ("strategy", "precision", "world_size", "global_batch", "device_type", "params", "task")
_NUM = (int, float)


def flatten(profile_text: str, start: dict[str, Any]) -> dict[str, bool | float | str]:
    """The hyperparameters of a session: the profile's scalar keys, then the start's."""
    out: dict[str, bool | float | str] = {}

    def walk(prefix: str, table: dict[str, Any]) -> None:
        for key, v in table.items():
            name = f"{prefix}{key}"
            if isinstance(v, dict):
                walk(f"{name}.", v)
            elif (value := _value(v)) is not None:
                out[name] = value

    walk("", toml_text.loads_or_empty(profile_text))
    for key in RESOLVED:
        if (value := _value(start.get(key))) is not None:
            out[f"run.{key}"] = value
    return out


def _value(v: Any) -> bool | float | str | None:
    if isinstance(v, bool | str):
        return v
    if type(v) in _NUM:
        return float(v) if math.isfinite(v) else str(v)
    if isinstance(v, list):
        try:
            return json.dumps(v)
        except (TypeError, ValueError):
            return None
    return None


def session_start(hparams: dict[str, bool | float | str], start_time: float):
    """The ``Summary`` that opens a session in the HParams tab (what the package's
    ``hparams_pb`` makes, without its numpy)."""
    from google.protobuf import struct_pb2
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=start_time)
    for name, v in hparams.items():
        value = struct_pb2.Value()
        if isinstance(v, bool):
            value.bool_value = v
        elif isinstance(v, float):
            value.number_value = v
        else:
            value.string_value = v
        info.hparams[name].CopyFrom(value)
    content = plugin_data_pb2.HParamsPluginData(version=0, session_start_info=info)
    meta = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name="hparams", content=content.SerializeToString()
        )
    )
    empty = tensor_pb2.TensorProto(  # the plugin's null tensor: a float vector of length 0
        dtype=types_pb2.DT_FLOAT,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=0)]
        ),
    )
    return summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=SESSION_START_TAG, metadata=meta, tensor=empty)]
    )


def final_train_loss(e: dict[str, Any]) -> dict[str, float]:
    """A step event's train loss as the HParams metric: its interval mean where it has one."""
    for key in ("loss_avg", "loss"):
        if type(e.get(key)) in _NUM:
            return {"final/train_loss": float(e[key])}
    return {}


def final_eval(e: dict[str, Any]) -> dict[str, float]:
    return {
        f"final/eval/{k}": float(v)
        for k, v in e.items()
        if k not in ("v", "t", "kind", "step") and type(v) in _NUM and not isinstance(v, bool)
    }
