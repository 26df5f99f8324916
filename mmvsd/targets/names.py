"""Names the light entry point (`mmvsd.targets`) and the heavy tower module (`.efficientnet`) share."""

TOWER_ARCHITECTURE = "mmvsd_efficientnet_lite0"  # the timm name of smol-llava's vision tower
