"""Buffer sync: a policy per registered buffer, applied across ranks.

Three parts:
- ``policies``: which policy each buffer gets, and how buffers are grouped (pure);
- ``sync``: ``BufferSync``, the per-step collectives, one per group;
- ``layout``: agreement across ranks on the synced buffers, at wrapping and after changes.
"""

from __future__ import annotations

from .policies import (
    POLICIES,
    BufferFn,
    BufferGroup,
    Policy,
    check_policy,
    check_rules,
    group_buffers,
    policy_label,
    resolve_policies,
)
from .sync import BufferSync

__all__ = [
    "POLICIES",
    "BufferFn",
    "BufferGroup",
    "BufferSync",
    "Policy",
    "check_policy",
    "check_rules",
    "group_buffers",
    "policy_label",
    "resolve_policies",
]
