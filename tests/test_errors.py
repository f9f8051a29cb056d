"""Who failed, as HTTP: the client's validation errors are 400, everything else of ours is 5xx."""

from __future__ import annotations

import pytest

from epd.encoders.media_limits import CorruptMediaError, MediaTooLargeError
from epd.errors import CapacityError, InternalError, InvalidRequestError, error_status
from epd.messages import MessageError


@pytest.mark.parametrize("exc", [InvalidRequestError("empty prompt", "prompt"),
                                 MediaTooLargeError("too big", modality="image"),
                                 CorruptMediaError("bad bytes", modality="video")])
def test_the_clients_errors_are_400(exc):
    assert error_status(exc) == 400


@pytest.mark.parametrize("exc", [ValueError("inconsistent block-table update"),  # an internal check
                                 MessageError("malformed control message"),  # a peer's bad message
                                 InternalError("x"), RuntimeError("x"), KeyError("x")])
def test_a_plain_value_error_is_ours_not_the_clients(exc):
    assert error_status(exc) == 500


def test_capacity_is_503():
    assert error_status(CapacityError("full")) == 503
