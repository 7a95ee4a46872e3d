"""The RL roles as actors; they meet only on the buses (see ``relax.cluster``)."""

from relax.roles._critic import CriticRole
from relax.roles._dataset import DatasetRole
from relax.roles._reference import ReferenceRole
from relax.roles._reward import RewardRole
from relax.roles._rollout import RolloutRole
from relax.roles._trainer import TrainerRole

__all__ = ["CriticRole", "DatasetRole", "ReferenceRole", "RewardRole", "RolloutRole", "TrainerRole"]
