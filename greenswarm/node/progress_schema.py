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
    state: pyd.constr(strict=True, regex=r"^(IDLE|SOLO|FEDERATED)$")  # type: ignore[valid-type]
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

    class Config:
        extra = pyd.Extra.forbid


class ProgressSchema(pyd.BaseModel):
    """The DHT key ``<swarm>_progress``: subkey = the owner's public key, value = one record."""

    progress: Dict[BytesWithPublicKey, RecordModel]  # noqa: UP006
