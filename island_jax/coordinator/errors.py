"""What the coordinator raises; the gRPC service turns each into a status code and the client back."""


class HandshakeError(ValueError):
    """An island's name, config fingerprint, round or initial parameter checksum differs from the coordinator's."""


class ContributionError(ValueError):
    """A contribution cannot be merged (wrong round, unknown island, bad payload, NaN/Inf)."""


class StaleRoundError(ContributionError):
    """An island asked for the update of a round older than the latest merged one; it should fetch the view."""


class UpdateNotReady(LookupError):
    """The update for a round is not merged yet (some islands have not contributed)."""
