"""Scripts raytrain measures itself against, shipped with the package (`raytrain bench --baseline`)."""
