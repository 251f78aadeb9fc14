"""What a model shows in ``describe``: Kubernetes-style events and conditions."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Optional

from ..units import iso

log = logging.getLogger("mlxfleet.supervisor")


class StatusRecord:
    """The last events of one model and its conditions (Ready, Progressing, ManifestValid)."""

    def __init__(self, name: str):
        self._record_name = name
        self.events: collections.deque = collections.deque(maxlen=50)
        self.conditions: dict[str, dict[str, Any]] = {}
        self.manifest_error: Optional[str] = None

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append({"time": iso(), "type": type_, "reason": reason,
                            "message": message})
        (log.warning if type_ == "Warning" else log.info)("%s: %s: %s", self._record_name,
                                                           reason, message)

    def set_condition(self, type_: str, status: bool, reason: str, message: str) -> None:
        cur = self.conditions.get(type_)
        st = "True" if status else "False"
        if cur and cur["status"] == st and cur["reason"] == reason \
                and cur["message"] == message:
            return
        changed = cur is None or cur["status"] != st
        self.conditions[type_] = {
            "type": type_, "status": st, "reason": reason, "message": message,
            "lastTransitionTime": iso() if changed else cur["lastTransitionTime"]}

    def set_manifest_error(self, message: Optional[str]) -> None:
        self.manifest_error = message
        if message:
            self.set_condition("ManifestValid", False, "ParseError",
                               f"{message} (serving the last good spec)")
        else:
            self.set_condition("ManifestValid", True, "Parsed", "manifest is valid")

    def record_status(self, created: float) -> dict[str, Any]:
        return {"createdAt": iso(created), "ageSeconds": round(time.time() - created, 1),
                "conditions": list(self.conditions.values()), "events": list(self.events)}
