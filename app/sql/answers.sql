-- steprecord_judged: the judge's answer row, declared once. Both judge functions,
-- steprecord_apply_event (apply_event.sql) and steprecord_apply_events (apply_events.sql),
-- return SETOF it: per event its index `i`, the `outcome`, whether a late report was
-- `recorded`, then the record's stored columns in the API's order (app/core/record.py;
-- tests/test_record_shape.py holds this type to it, and the other functions that answer
-- records, whose rows differ, to the same columns).
--
-- A caller reads `SELECT * FROM steprecord_apply_event(...)`: the same columns, names and
-- types as the `RETURNS TABLE` the two functions declared before revision 0038, so a
-- statement a running service prepared before that revision is planned again, not refused.
--
-- PostgreSQL has no CREATE OR REPLACE TYPE: a revision that changes this file drops the type,
-- and first every function whose arguments or result name it, and creates them all again
-- (`python -m app.sql freeze` writes those drops). This file's name sorts before the files
-- of those functions: app/sql/ is installed in name order, and a function's result type
-- must exist when the function is created.
CREATE TYPE steprecord_judged AS (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text
);
