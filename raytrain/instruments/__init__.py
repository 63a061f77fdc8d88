"""What a worker measures and watches beside the loop: a step's phases and the attempt's own
time (`phases`), the loss between syncs (`window`), stragglers, replica agreement and stuck
replicas (`watch`, `agreement`)."""
