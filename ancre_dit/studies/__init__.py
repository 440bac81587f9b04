"""Studies: training runs (arms x seeds) that settle one question, with a report of how sure the answer is.
Executors: local subprocesses N at a time (runner) or submitit with requeues (cluster)."""
from .spec import Job, Study, load_study, validate
