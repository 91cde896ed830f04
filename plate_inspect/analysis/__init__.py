"""Model analyses on small models: weight-vs-activation alignment and Gauss-Newton curvature."""
