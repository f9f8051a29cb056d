"""Setting the replicas ``epd plan recommend --apply`` chose: the prefill and decode pools (the
encode pool, not modelled, is left alone), through one of two connectors, after Dynamo's
planner's ``connectors/{kubernetes,virtual}``:

- ``local``: writes ``{"prefill": M, "decode": K}`` into ``--state`` (a JSON file, keeping
  its other pools);
- ``kubernetes``: runs ``kubectl scale deployment/epd-<pool> --replicas=R -n NS`` for the
  per-pool Deployments of deploy/ (the scale subresource).

``--dry-run`` prints the commands instead.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from epd.ops.plan.errors import PlanError
from epd.roles import Role

__all__ = ["DEPLOYMENTS", "apply", "kubectl_commands", "write_file"]

#: the pools' Deployments of deploy/base (the scale subresource ``kubectl scale`` drives)
DEPLOYMENTS = {r: f"epd-{r}" for r in (Role.ENCODE, Role.PREFILL, Role.DECODE)}


def kubectl_commands(replicas: dict[str, int], namespace: str) -> list[list[str]]:
    """``kubectl scale deployment/epd-<pool> --replicas=R -n NS`` per pool (the scale subresource)."""
    return [["kubectl", "scale", f"deployment/{DEPLOYMENTS[pool]}", f"--replicas={n}", "-n", namespace]
            for pool, n in replicas.items()]


def apply(replicas: dict[str, int], connector: str, *, state: str | Path = "epd-plan-replicas.json",
          namespace: str = "epd", dry_run: bool = False, out=print) -> None:
    """Set the replicas of the pools ``replicas`` names (others are left alone): ``local``
    writes them into ``state`` (JSON, keeping its other pools), ``kubernetes`` runs kubectl
    (``dry_run``: prints the commands). Raises PlanError when kubectl fails or ``state`` is
    not a connector state."""
    if connector == "local":
        merged = {**_state_of(Path(state)), **replicas}  # pools not named keep their replicas
        if dry_run:
            out(f"would write {json.dumps(merged)} to {state}")
            return
        write_file(Path(state), json.dumps(merged, indent=2) + "\n")
        out(f"wrote {json.dumps(merged)} to {state}")
        return
    for cmd in kubectl_commands(replicas, namespace):
        out(" ".join(cmd))
        if not dry_run:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise PlanError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")


def _state_of(path: Path) -> dict:
    """The local connector's replicas so far ({} when the file is missing); raises PlanError
    when it is not a JSON object of pool -> replicas."""
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read the local connector's state {path}: {e}") from None
    if not isinstance(state, dict):
        raise PlanError(f"{path} is not the local connector's state (a JSON object of pool -> replicas)")
    return state


def write_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path``. Raises PlanError when it cannot."""
    try:
        path.write_text(text)
    except OSError as e:
        raise PlanError(f"cannot write {path}: {e.strerror or e}") from None
