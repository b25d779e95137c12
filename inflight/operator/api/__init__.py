"""The ModelServer API: the pydantic types (the one source of truth), the CRD rendered from them and the
RBAC rules derived from the operator's API calls."""
