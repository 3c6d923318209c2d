"""Who may use the embedded server: the run's roles, and its rollout nodes but the quarantined, kept true while it runs.

The server's users are rendered from the run's credential files (``streams/credentials.py``) with the per-role
permissions (``streams/permissions.py``). Every launcher turn :meth:`ServerAccess.sync` compares what the server
was given with what should be:

- a node credential that appeared in ``credentials/nodes`` (``astraflow node add NAME``, or a node ``up`` starts:
  :meth:`ServerAccess.let_in`) is let in;
- a node the dataflow quarantined (``DataflowState.quarantined``, ``dataflow/reputation.py``) is shut out: its
  credential is revoked on the running server, which closes the node's connection and refuses it from then on;
- a node let back in (``astraflow node admit NAME``: the dataflow lifts the quarantine) gets its credential back;
- a node whose file is gone (``astraflow node revoke NAME``) is out for good: a new ``node add`` makes a new secret.

Each change re-renders the config and reloads the server (SIGHUP): it re-reads its users, closes the connections of
users that are gone, and everyone else stays connected. A server ``up`` did not start (``--nats``) cannot be
reloaded from here: there a quarantined node is refused by the dataflow only.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from astraflow.streams.credentials import Credential, issue_node, issued, node_names, server_users
from astraflow.streams.permissions import Scope, render_accounts
from astraflow.streams.server import EmbeddedServer


class ServerAccess:
    """The embedded server's users, from the credential files under ``cred_dir`` (``servers``: attached once started;
    a cluster's members each)."""

    def __init__(self, cred_dir: Path, run: str, policies: tuple[str, ...], scope: Scope, tail: str = "") -> None:
        self.cred_dir, self.run, self.policies, self.scope = cred_dir, run, policies, scope
        self.tail = tail  # config after the accounts (TLS)
        self.servers: list[EmbeddedServer] = []
        self.quarantined: frozenset[str] = frozenset()
        self._applied: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())  # (nodes, shut out) the server has

    def config(self) -> str:
        """The server config's accounts (and TLS) for the credentials on disk now, the quarantined nodes left out;
        recorded as what the server has."""
        nodes = frozenset(node_names(self.cred_dir))
        shut = self.quarantined & nodes
        creds = issued(self.cred_dir, self.policies)  # as ``up`` and ``node add`` wrote them: nothing rewritten per reload
        self._applied = (nodes, shut)
        return render_accounts(server_users(creds, self.policies, shut), self.scope) + self.tail

    def let_in(self, name: str) -> Credential:
        """Node ``name``'s credential (made if new), known to the running server before this returns."""
        cred = issue_node(self.cred_dir, self.run, name, ",".join(s.url for s in self.servers))
        self.sync(self.quarantined)
        return cred

    def sync(self, quarantined: Collection[str]) -> list[str]:
        """Give the running server the users it should have now; what changed, in words (empty: nothing)."""
        self.quarantined = frozenset(quarantined)
        nodes = frozenset(node_names(self.cred_dir))
        shut = self.quarantined & nodes
        before_nodes, before_shut = self._applied
        if not self.servers or (nodes, shut) == self._applied:
            return []
        try:
            config = self.config()
            for server in self.servers:
                server.reload(config)
        except Exception:
            self._applied = (before_nodes, before_shut)  # tried again next turn
            raise
        changes = [f"node {n} revoked (quarantined)" for n in sorted(shut - before_shut)]
        changes += [f"node {n} let back in" for n in sorted((before_shut - shut) & nodes)]
        changes += [f"node {n} joined" for n in sorted(nodes - before_nodes - shut)]
        changes += [f"node {n} removed" for n in sorted(before_nodes - nodes)]
        return changes
