"""Third-party notices that are not the user's, left out at the source and only around torchpar's own calls: Ray's
token-authentication notice when torchpar starts its embedded cluster of simulated hosts."""

from __future__ import annotations

import importlib
import logging

from torchpar.runtime.ray import ray_cluster


def test_the_token_notice_is_left_out_only_while_torchpar_starts_its_cluster():
    setup = importlib.import_module("ray._private.authentication.authentication_token_setup")
    assert setup.logger.name == ray_cluster.TOKEN_NOTICE_LOGGER  # Ray still logs the notice there
    notices = logging.getLogger(ray_cluster.TOKEN_NOTICE_LOGGER)
    before = notices.level
    with ray_cluster._quiet_token_notice():
        assert not notices.isEnabledFor(logging.WARNING) and notices.isEnabledFor(logging.ERROR)
    assert notices.level == before  # the user's own ray.init shows it again
