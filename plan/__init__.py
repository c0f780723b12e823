"""The machinery op families and TensorRT plugins share (the bottom package): the dtype table, launch
plans (`launch`), the op-implementation choice (`kernels`) and the ONNX node spec (`onnx_node`)."""
