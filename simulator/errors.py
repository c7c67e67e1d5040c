"""memsim's error hierarchy: every user-facing failure is a MemsimError with a one-line message."""


class MemsimError(Exception):
    """Base of every error memsim raises on bad input or impossible requests."""

    exit_code = 2


class ScenarioError(MemsimError):
    """A scenario file, key or value is invalid (message names file, key path, value, rule)."""


class TopologyError(MemsimError):
    """A cluster or device definition is unknown or malformed."""


class PlanError(MemsimError):
    """A parallel plan does not fit the model or the cluster."""


class ScheduleError(MemsimError):
    """A pipeline schedule is malformed or cannot run."""


class DeadlockError(MemsimError):
    """The engine reached a state where no instruction can make progress."""


class DataError(MemsimError):
    """A measured-data or calibration file is missing, corrupt or does not match."""


class ExecutorError(MemsimError):
    """An executor specification is malformed, or its workers or scheduler cannot be reached."""
