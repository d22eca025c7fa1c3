"""berth's monitoring kit (manifests/monitoring/), as code: the Grafana dashboard's panels, the
generator of the kit's derived files, a real Prometheus to evaluate them against, the shipped
scrape config run without a Kubernetes API, and the README's picture of the dashboard. Tools
for a checkout (they read and write manifests/): nothing here runs in the operator's pod."""
