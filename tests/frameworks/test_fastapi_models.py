"""The status route's view of the leader is derived from `LeaderInfo`: same fields, same
types, same defaults (``keys`` left out, `LeaderStatus` has them), so the two cannot
drift (they had: ``Mapping`` in one, ``dict`` in the other)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import typing
from types import MappingProxyType
from typing import Any

from pydantic import create_model

from pgleaderlock import LeaderInfo, LockState
from pgleaderlock.integrations.fastapi import LeaderStatus, LeaderView
from pgleaderlock.integrations.fastapi.models import LEFT_OUT, view_fields


def test_the_view_has_every_field_of_leader_info_but_keys() -> None:
    info_fields = {f.name: f for f in dataclasses.fields(LeaderInfo)}
    hints = typing.get_type_hints(LeaderInfo)
    assert frozenset({"keys"}) == LEFT_OUT
    assert "keys" in info_fields
    assert list(LeaderView.model_fields) == [n for n in info_fields if n != "keys"]
    for name, field in LeaderView.model_fields.items():
        assert field.annotation == hints[name], name
        default = info_fields[name].default
        if default is dataclasses.MISSING:
            assert field.is_required(), name
        else:
            assert field.default == default, name


def test_a_field_added_to_leader_info_reaches_the_view() -> None:
    # As if LeaderInfo grew a field: the derivation takes it along, type and default.
    grown = dataclasses.make_dataclass(
        "GrownInfo",
        [("zone", str | None, dataclasses.field(default=None))],
        bases=(LeaderInfo,),
        frozen=True,
    )
    fields = view_fields(grown)
    assert list(fields) == [*LeaderView.model_fields, "zone"]
    assert fields["zone"] == (str | None, None)
    model: Any = create_model("GrownView", **fields)
    info = grown(keys=(1, 2), pid=7, application_name="a", role="r", zone="eu-1")
    assert model.model_validate(info, from_attributes=True).zone == "eu-1"


def test_the_view_serializes_as_the_status_route_always_did() -> None:
    since = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
    info = LeaderInfo(
        keys=(1, 2),
        pid=42,
        application_name="pgleaderlock:x@host:1",
        role="app",
        identity="web-1",
        name="x",
        priority=3,
        metadata=MappingProxyType({"url": "http://web-1"}),
        since=since,
        term=5,
        trusted=True,
    )
    view = LeaderView.of(info)
    assert view is not None
    assert LeaderView.of(None) is None
    assert json.loads(view.model_dump_json()) == {
        "pid": 42,
        "application_name": "pgleaderlock:x@host:1",
        "role": "app",
        "identity": "web-1",
        "name": "x",
        "priority": 3,
        "metadata": {"url": "http://web-1"},
        "since": "2026-11-29T12:00:00Z",
        "term": 5,
        "trusted": True,
    }
    status = LeaderStatus(
        name="x",
        keys=(1, 2),
        state=LockState.FOLLOWER,
        is_leader=False,
        ready=True,
        leader_since=None,
        term=None,
        last_error=None,
        tasks=[],
        leader=view,
    )
    assert json.loads(status.model_dump_json())["leader"]["metadata"] == {"url": "http://web-1"}
    schema = LeaderStatus.model_json_schema()
    assert "LeaderView" in schema["$defs"]
    assert set(schema["$defs"]["LeaderView"]["properties"]) == set(LeaderView.model_fields)
