"""``astraflow node``: an operator's hand on a run's rollout nodes, from the run directory.

- ``add NAME``: the node's own credential (``RUN_DIR/credentials/nodes/NAME.json``); the running ``up`` lets it in on
  its next turn (``access.py``), and the command returns once the server does. Hand the file to the machine:
  ``astraflow worker rollout --credential NAME.json --recipe recipe.yaml``.
- ``revoke NAME``: the credential is deleted; ``up`` takes the user off its server, which closes the node's connection.
- ``admit NAME``: lets a quarantined node back in (an :class:`~astraflow.streams.state.AdmitRecord`): the dataflow lifts
  the quarantine at its next audit, and ``up`` gives the node its credential back.
- ``list``: every node with a credential, and the quarantined ones with why (``astraflow status`` shows them too).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from astraflow.launch.rundir import RunDir
from astraflow.streams.credentials import Credential, issue_node, node_names, node_path
from astraflow.streams.dataflow_state import DataflowState, Quarantine
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.state import AdmitRecord


def _admin(run_dir: Path) -> tuple[RunDir, Path]:
    rundir = RunDir(run_dir)
    admin = rundir.credentials / "admin.json"
    if not admin.exists():
        raise FileNotFoundError(f"{run_dir} has no credentials/admin.json: not the directory of a run `astraflow up` secured")
    return rundir, admin


def add(run_dir: Path, name: str) -> Path:
    """Node ``name``'s credential file (a new secret unless it has one), with the server's address and CA."""
    rundir, admin = _admin(run_dir)
    server = Credential.read(admin)
    issue_node(rundir.credentials, server.run, name, server.url, server.tls_ca_pem)
    return node_path(rundir.credentials, name)


async def served(credential: Path, timeout: float = 10.0) -> bool | None:
    """Wait until the run's server lets ``credential`` in (the running ``up`` reloads its users within a turn): True;
    False when it still refuses it after ``timeout`` seconds; None when no server answers at its address."""
    cred = Credential.read(credential)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            plane = await Plane.connect(NatsOptions.from_credential(str(credential)), cred.run, "node-add", wait=2)
        except PermissionError:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.25)
            continue
        except ConnectionError:
            return None
        await plane.close()
        return True


def revoke(run_dir: Path, name: str) -> bool:
    """Delete node ``name``'s credential (for good: ``add`` makes a new secret); whether it had one."""
    rundir, _ = _admin(run_dir)
    path = node_path(rundir.credentials, name)
    if not path.exists():
        return False
    path.unlink()
    return True


async def _plane(run_dir: Path, worker_id: str) -> Plane:
    _, admin = _admin(run_dir)
    return await Plane.connect(NatsOptions.from_credential(str(admin)), Credential.read(admin).run, worker_id, wait=10)


async def admit(run_dir: Path, name: str, by: str = "operator") -> Quarantine | None:
    """Let node ``name`` back in; the quarantine it was under (None: it was not quarantined, nothing written)."""
    plane = await _plane(run_dir, "node-admit")
    try:
        state = await plane.state.get(DataflowState)
        q = state.quarantined.get(name) if state is not None else None
        if q is not None:
            await plane.state.put(AdmitRecord(node=name, by=by, quarantined_at=q.at))  # this quarantine, on the dataflow's clock
        return q
    finally:
        await plane.close()


async def standing(run_dir: Path) -> tuple[list[str], dict[str, Quarantine]]:
    """The nodes with a credential, and the quarantined (from the dataflow's state on the server)."""
    rundir, _ = _admin(run_dir)
    plane = await _plane(run_dir, "node-list")
    try:
        state = await plane.state.get(DataflowState)
    finally:
        await plane.close()
    return node_names(rundir.credentials), dict(state.quarantined) if state is not None else {}
