"""The router: the one door every request passes (validation, text encoding, stop policy),
placement on workers, and the relay of their results."""
