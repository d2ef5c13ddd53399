"""What the backends build from: offline math that turns a layer's weights and calibration
statistics into the stored layer of an op (numpy/scipy), and the graph patterns a pass rewrites.
One module per backend; each imports only the kit and custom_ops, never a backend."""
