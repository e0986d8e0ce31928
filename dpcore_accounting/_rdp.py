"""dp-accounting's RDP accountant without its per-order "failed to converge" log lines.

Contract:
  * `QuietRdpAccountant` is `dp_accounting.rdp.RdpAccountant` (same results, same type checks);
    only while it composes an event does a filter on the absl logger drop the records that
    `_compute_log_a_frac` logs when its series does not converge for a fractional order.
  * Such an order is excluded from the minimum over orders, so ε is still a valid upper bound
    (from fewer orders); nothing for a user to act on, but printed once per order and per
    accountant it reads as a failure (e.g. q ≈ 0.09, σ = 1 on the digits main job). The
    dropped orders are logged at DEBUG level on this module's logger instead.
  * The filter is scoped to the `compose` call and to exactly that message from dp-accounting's
    RDP module: other warnings (a negative Rényi divergence, anything else on the absl logger)
    pass, and no global logging or warnings setting changes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from absl import logging as absl_logging
from dp_accounting import dp_event, rdp

__all__ = ["QuietRdpAccountant", "dropping_convergence_warnings"]

_LOG = logging.getLogger(__name__)
_CONVERGENCE_MESSAGE = "_compute_log_a_frac failed to converge"
_RDP_MODULE = "rdp_privacy_accountant"


class _DropConvergenceWarnings(logging.Filter):
    """Drops dp-accounting's RDP convergence warnings; remembers the orders they name."""

    def __init__(self) -> None:
        super().__init__()
        self.orders: list[float] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.module == _RDP_MODULE
            and isinstance(record.msg, str)
            and record.msg.startswith(_CONVERGENCE_MESSAGE)
        ):
            args = record.args if isinstance(record.args, tuple) else ()
            alpha = args[-1] if args else None  # (iterations, q, sigma, alpha)
            if isinstance(alpha, (int, float)):
                self.orders.append(alpha)
            return False
        return True


@contextlib.contextmanager
def dropping_convergence_warnings() -> Iterator[list[float]]:
    """Within the block, dp-accounting's RDP convergence warnings are not emitted.

    Yields:
      The list that collects the orders whose warning was dropped.
    """
    logger = absl_logging.get_absl_logger()
    dropper = _DropConvergenceWarnings()
    logger.addFilter(dropper)
    try:
        yield dropper.orders
    finally:
        logger.removeFilter(dropper)


class QuietRdpAccountant(rdp.RdpAccountant):
    """`RdpAccountant` whose `compose` drops the per-order convergence warnings (see module)."""

    def compose(self, event: dp_event.DpEvent, count: int = 1) -> Any:
        with dropping_convergence_warnings() as orders:
            result = super().compose(event, count)
        if orders:
            _LOG.debug(
                "RDP orders %s excluded by dp-accounting (series did not converge)",
                sorted(set(orders)),
            )
        return result
