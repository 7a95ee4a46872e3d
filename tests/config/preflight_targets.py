"""Import targets for the malformed-config files of tests/config/bad that only the preflight
(relax.preflight) can reject: they import, but are not what the cluster calls."""

from __future__ import annotations

NOT_CALLABLE = 42


def score(response, sample, **options):
    return 1.0


def no_arguments():
    """An agent program that takes none of (base_url, api_key, task)."""


def strict_env():
    """An environment factory that takes no options."""


class NotAnActor:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
