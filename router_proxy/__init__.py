"""router_proxy package."""
