"""Sample quality: ADM-comparable Inception metrics (FID, sFID, IS, precision, recall, KID) and the
offline digits check (which is not FID-50K)."""
from .digits_metric import digits_report, format_digits_report
from .inception import (
    WEIGHTS_NAME, InceptionExtractor, InceptionFeatures, check_weights, write_random_inception_weights,
)
from .metrics import (
    feature_statistics, frechet_distance, frechet_distance_to_features, inception_score, kernel_inception_distance,
    precision_recall,
)
from .pipeline import (
    DEFAULT_METRICS, METRICS, EvaluationResult, compute_metrics, evaluate, format_table, save_reference_stats,
)
