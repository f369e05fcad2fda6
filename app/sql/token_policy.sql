-- Once a token has existed, having none left does not reopen anonymous access.
--
-- Whenever a token is inserted (by `steprecord token create` or by hand), access_policy's
-- one row says tokens_required, so revoking the last token closes the service instead of
-- opening it. It upserts, so a policy row deleted by hand comes back. Only `steprecord
-- token allow-anonymous` sets it back to false, an explicit choice. The time is a value of
-- the row inserted (EXCLUDED), not a clock call in the update: Citus runs only IMMUTABLE
-- functions there, should access_policy ever be distributed (it stays on the coordinator).
CREATE OR REPLACE FUNCTION api_token_require_tokens() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO access_policy (tokens_required, updated_at) VALUES (true, now())
    ON CONFLICT (id) DO UPDATE SET tokens_required = true, updated_at = EXCLUDED.updated_at
    WHERE NOT access_policy.tokens_required;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_api_token_requires_tokens
AFTER INSERT ON api_token
FOR EACH ROW EXECUTE FUNCTION api_token_require_tokens();
