"""`digits`: 8×8 handwritten digits (1,797 images, 10 classes), a small CNN.

The images are the UCI optical-recognition test set as shipped by scikit-learn,
stored here (`digits.npz`, 45 KB) so the pipeline needs no download.
"""

from pipelines.digits.pipeline import DigitsPipeline

__all__ = ["DigitsPipeline"]
