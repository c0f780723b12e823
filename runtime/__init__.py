"""Running an export folder: runners (eager, pt2, ort, trt, aoti), CUDA graphs, the distributed run,
verify."""
