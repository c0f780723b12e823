"""Export stages: trace (torch.export), onnx, trt, aoti, verify — each a plain function over typed artifacts."""
