"""The RL roles as actors; they meet only on the buses (see ``relax.cluster``).

Besides the roles, the steps of one RL iteration that the synchronous runner (``relax.sync``)
drives without actors or buses: ``prompt_stream``/``prompt_row`` (a dataset's prompts, as bus
rows), ``generate_groups`` (a group of completions per prompt), ``sample_rows`` (the rows a
rollout puts for them), ``score_rows`` (their rewards;
``PROMPT_FOR_REWARD`` maps a row's prompt columns to what a reward function reads).
``EvalRole`` is the evaluator of ``[eval]`` (``eval_metrics``: mean reward, pass@1, pass@k).
"""

from relax.roles._critic import CriticRole
from relax.roles._dataset import DatasetRole
from relax.roles._eval import EVAL_FILE, EVAL_TENSORBOARD_DIR, EvalRole, eval_metrics
from relax.roles._prompts import prompt_row, prompt_stream
from relax.roles._reference import ReferenceRole
from relax.roles._reward import RewardRole, score_rows
from relax.roles._rollout import PROMPT_FOR_REWARD, RolloutRole, generate_groups, sample_rows
from relax.roles._trainer import TrainerRole

__all__ = [
    "EVAL_FILE",
    "EVAL_TENSORBOARD_DIR",
    "PROMPT_FOR_REWARD",
    "CriticRole",
    "DatasetRole",
    "EvalRole",
    "ReferenceRole",
    "RewardRole",
    "RolloutRole",
    "TrainerRole",
    "eval_metrics",
    "generate_groups",
    "prompt_row",
    "prompt_stream",
    "sample_rows",
    "score_rows",
]
