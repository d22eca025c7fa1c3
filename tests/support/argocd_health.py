"""Run the shipped Argo CD health check (manifests/argocd/health.lua) as Argo CD does: Lua 5.1
(gopher-lua), the object as nested tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51

ARGOCD = Path(__file__).resolve().parents[2] / "manifests" / "argocd"
SCRIPT = (ARGOCD / "health.lua").read_text()


def to_lua(lua: Any, value: Any) -> Any:
    """Dicts become tables, lists 1-based sequences (how Argo CD hands objects to Lua)."""
    if isinstance(value, dict):
        return lua.table_from({key: to_lua(lua, item) for key, item in value.items()})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, item) for item in value])
    return value


def argocd_health(obj: dict[str, Any]) -> dict[str, Any]:
    """{"status": Healthy | Progressing | Degraded | Suspended, "message": ...}"""
    lua = lupa.lua51.LuaRuntime(unpack_returned_tuples=True, register_eval=False)
    assert lua.eval("_VERSION") == "Lua 5.1"
    lua.globals().obj = to_lua(lua, obj)
    result = lua.execute(SCRIPT)
    return dict(result.items())
