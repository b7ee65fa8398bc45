"""The one way a pass rejects a candidate: raise ``NoMatch`` where the reason is found, note it
where the candidate is given up, so every reason reaches the report the same way."""


class NoMatch(Exception):
    """Why a candidate was left alone; the message becomes a note in the pass report."""
