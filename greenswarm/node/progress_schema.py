"""Pydantic models of the progress record, for hivemind's ``SchemaValidator``.

Kept apart from ``progress.py`` because hivemind's validator needs pydantic's v1 API with real (not
postponed) annotations, and strict types: the validator rejects any value pydantic would convert.
"""

from typing import Dict, Optional  # noqa: UP035  (pydantic v1 resolves these generics)

import pydantic.v1 as pyd
from hivemind.dht.schema import BytesWithPublicKey


class PlanModel(pyd.BaseModel):
    """A shared deadline plan: what the site can still train before the deadline, and how clean."""

    deadline: pyd.StrictFloat
    target: pyd.conint(strict=True, ge=1)  # type: ignore[valid-type]
    values: pyd.conlist(pyd.StrictFloat, max_items=64)  # type: ignore[valid-type]
    work_tokens: pyd.confloat(strict=True, ge=0)  # type: ignore[valid-type]
    at: pyd.StrictFloat  # clock time it was planned: the part of its horizon since then is gone

    class Config:
        extra = pyd.Extra.forbid


class RecordModel(pyd.BaseModel):
    site: pyd.StrictStr
    region: pyd.StrictStr
    state: pyd.constr(strict=True, regex=r"^(IDLE|SOLO|FEDERATED|RELEASED|RESTARTING)$")  # type: ignore[valid-type]
    peer_id: pyd.StrictStr
    outer_round: pyd.conint(strict=True, ge=0)  # type: ignore[valid-type]
    lineage: pyd.StrictStr
    round_index: pyd.StrictInt
    local_steps: pyd.conint(strict=True, ge=0)  # type: ignore[valid-type]
    tokens: pyd.conint(strict=True, ge=0)  # type: ignore[valid-type]
    loss: Optional[pyd.StrictFloat]  # noqa: UP045
    window_end: Optional[pyd.StrictFloat]  # noqa: UP045
    energy_kwh: pyd.StrictFloat
    emissions_g: pyd.StrictFloat
    clock_time: pyd.StrictFloat
    wall_time: pyd.StrictFloat
    world_size: pyd.conint(strict=True, ge=1)  # type: ignore[valid-type]
    version: pyd.StrictInt
    wire: Optional[pyd.StrictStr] = None  # noqa: UP045  (the last averaged round's wire format)
    refused: pyd.conint(strict=True, ge=0) = 0  # type: ignore[valid-type]  (updates refused so far)
    next_start: Optional[pyd.StrictFloat] = None  # noqa: UP045  (the deadline plan's next start)
    plan: Optional[PlanModel] = None  # noqa: UP045  (a shared deadline plan)
    model: Optional[pyd.constr(strict=True, max_length=256)] = None  # type: ignore[valid-type]  # noqa: UP045
    state_digest: Optional[pyd.constr(strict=True, max_length=64)] = None  # type: ignore[valid-type]  # noqa: UP045
    eval_loss: Optional[pyd.StrictFloat] = None  # noqa: UP045  (the global model's held-out loss)
    eval_round: Optional[pyd.conint(strict=True, ge=0)] = None  # type: ignore[valid-type]  # noqa: UP045
    eval_digest: Optional[pyd.constr(strict=True, max_length=64)] = None  # type: ignore[valid-type]  # noqa: UP045

    class Config:
        extra = pyd.Extra.forbid


#: at most this many shards in a claimed corpus (greenswarm.node.data.MAX_CLAIMED_SHARDS)
_MAX_SHARDS = 1024
_Count = pyd.conint(strict=True, ge=0)


class LeaseModel(pyd.BaseModel):
    """One site's hold on one claimed shard (greenswarm.node.shard_records.Lease)."""

    shard: _Count  # type: ignore[valid-type]
    claimed_at: pyd.StrictFloat
    until: pyd.StrictFloat
    token: pyd.constr(strict=True, max_length=64)  # type: ignore[valid-type]
    rank: _Count  # type: ignore[valid-type]

    class Config:
        extra = pyd.Extra.forbid


class ShardRecordModel(pyd.BaseModel):
    """A site's record of the swarm's claimed shards (greenswarm.node.shard_records.ShardRecord)."""

    site: pyd.StrictStr
    peer_id: pyd.StrictStr
    dataset: pyd.constr(strict=True, max_length=64)  # type: ignore[valid-type]
    count: pyd.conint(strict=True, ge=1, le=_MAX_SHARDS)  # type: ignore[valid-type]
    leases: pyd.conlist(LeaseModel, max_items=_MAX_SHARDS)  # type: ignore[valid-type]
    # [shard, epoch, document, offset] and [shard, documents]
    positions: pyd.conlist(pyd.conlist(_Count, min_items=4, max_items=4), max_items=_MAX_SHARDS)  # type: ignore[valid-type]
    sizes: pyd.conlist(pyd.conlist(_Count, min_items=2, max_items=2), max_items=_MAX_SHARDS)  # type: ignore[valid-type]
    excluded: pyd.conlist(_Count, max_items=_MAX_SHARDS)  # type: ignore[valid-type]  (held out)
    wall_time: pyd.StrictFloat
    version: pyd.StrictInt

    class Config:
        extra = pyd.Extra.forbid


class ProgressSchema(pyd.BaseModel):
    """The DHT keys ``<swarm>_progress`` (one record per site) and ``<swarm>_shards`` (one shard record
    per site that claims shards): subkey = the owner's public key."""

    progress: Dict[BytesWithPublicKey, RecordModel]  # noqa: UP006
    shards: Dict[BytesWithPublicKey, ShardRecordModel]  # noqa: UP006
