// placeholder: implementation lands with its component
