"""Pure builders of the objects a ModelServer owns: the server's Deployment and Service, the HPA or KEDA
ScaledObject, and the model cache's claim and download Job."""
