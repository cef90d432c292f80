"""Attacks as a fault to inject: a peer that runs the same strategy, transport and keys as
every other, but sends harmful models (docs/ARCHITECTURE.md, Attacks).

``kinds`` holds what each attack sends (pure, seeded), ``spec`` who attacks with what
(``Attack``, ``Attacks``: TrainConfig's ``attack``, the ``--attack`` flag), ``sender`` the
wrapper around an attacker's transport that puts the payloads into its messages.
"""

from gossip.attacks.kinds import ATTACKS, AttackKind, View
from gossip.attacks.sender import Attacker
from gossip.attacks.spec import FLAG, Attack, Attacks

__all__ = ["ATTACKS", "Attack", "AttackKind", "Attacker", "Attacks", "FLAG", "View"]
