"""The Flotilla operator (kopf): reconciles FlotillaPool custom resources into worker Deployments and
Services and scales them with the autoscaler's control law from the router's signals."""
