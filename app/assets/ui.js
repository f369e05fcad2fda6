// steprecord dashboard: live updates of an instance page from its event stream.
// Data is only ever set as text (textContent, attributes), never parsed as markup.
(function () {
  "use strict";
  var main = document.getElementById("instance");
  if (!main || !window.EventSource) return;
  var SVG = "http://www.w3.org/2000/svg";
  var GLYPHS = {pending: "○", running: "▶", completed: "✓", failed: "✗", superseded: "↷", swept: "⊘"};
  // The page comes in chunks of steps: a <svg> of lanes and a <table> of rows each.
  var timeline = document.getElementById("timeline");
  var LABEL = +timeline.dataset.label, AREA = +timeline.dataset.area, LANE = +timeline.dataset.lane;
  var key = main.dataset.key;
  var rows = new Map(), lanes = new Map();
  document.querySelectorAll("#steps tbody tr").forEach(function (tr) { rows.set(tr.dataset.step, tr); });
  timeline.querySelectorAll("g.lane").forEach(function (g) { lanes.set(g.dataset.step, g); });

  function ms(text) { return text ? Date.parse(text) : NaN; }
  function utc(t) { return isNaN(t) ? "" : new Date(t).toISOString().slice(0, 19).replace("T", " ") + " UTC"; }
  function duration(s) {
    s = Math.max(s, 0);
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 60) return s.toFixed(1) + " s";
    var w = Math.floor(s), units = [["d", 86400, "h", 3600], ["h", 3600, "min", 60], ["min", 60, "s", 1]];
    for (var i = 0; i < units.length; i++) {
      var u = units[i];
      if (w >= u[1]) {
        var rest = Math.floor((w % u[1]) / u[3]);
        return Math.floor(w / u[1]) + " " + u[0] + (rest ? " " + rest + " " + u[2] : "");
      }
    }
  }
  function mark(status, code) { return status === "failed" && code === "lease_expired" ? "swept" : status; }
  function stepUrl(slug) {
    return "/ui/instances/" + encodeURIComponent(key) + "/steps/" + encodeURIComponent(slug);
  }
  function badge(status, code) {
    var m = mark(status, code), span = document.createElement("span"), g = document.createElement("span");
    span.className = "badge " + m;
    g.className = "glyph"; g.setAttribute("aria-hidden", "true"); g.textContent = GLYPHS[m];
    span.append(g, " " + (m === "swept" ? "failed, lease expired" : status));
    return span;
  }

  // Place the bars: the scale runs from the first start to past the last end (running bars
  // end now). It has 5% of room to spare, so as running bars grow only they move, until
  // they reach its end and every bar is placed again.
  var scaleFirst = timeline.dataset.first ? +timeline.dataset.first : NaN;
  var scaleEnd = timeline.dataset.end ? +timeline.dataset.end : NaN;
  function place(b, now) {
    var s = +b.dataset.start, e = b.dataset.end ? +b.dataset.end : now, span = scaleEnd - scaleFirst;
    b.setAttribute("x", (LABEL + (s - scaleFirst) / span * AREA).toFixed(3) + "%");
    b.setAttribute("width", Math.max((e - s) / span * AREA, 0.15).toFixed(3) + "%");
  }
  function layout(all) {
    var now = Date.now(), first = Infinity, last = -Infinity, bars = timeline.querySelectorAll("rect.bar");
    bars.forEach(function (b) {
      var s = +b.dataset.start, e = b.dataset.end ? +b.dataset.end : now;
      if (s < first) first = s;
      if (e > last) last = e;
    });
    if (!bars.length) return;
    if (all || isNaN(scaleFirst) || first < scaleFirst || last > scaleEnd) {
      scaleFirst = first;
      scaleEnd = last + Math.max(last - first, 1000) * 0.05;
      bars.forEach(function (b) { place(b, now); });
      document.getElementById("t-first").textContent = utc(scaleFirst);
      document.getElementById("t-last").textContent = utc(scaleEnd);
    } else {
      timeline.querySelectorAll("rect.bar[data-end='']").forEach(function (b) { place(b, now); });
    }
  }
  function tick() {
    var now = Date.now();
    if (timeline.querySelector("rect.bar[data-end='']")) layout(false);
    document.querySelectorAll("#steps td.duration[data-end='']").forEach(function (td) {
      if (td.dataset.start) td.textContent = duration((now - td.dataset.start) / 1000);
    });
  }

  function counts() {
    var c = {failed: 0, running: 0, pending: 0, completed: 0};
    rows.forEach(function (tr) { c[tr.dataset.status] += 1; });
    var box = document.createElement("span");
    box.className = "counts";
    ["failed", "running", "pending", "completed"].forEach(function (s) {
      if (!c[s]) return;
      var item = document.createElement("span");
      item.className = "count " + s;
      item.textContent = GLYPHS[s] + " " + c[s] + " " + s;
      box.append(item, " ");
    });
    document.getElementById("counts").replaceChildren(box);
  }

  function newRow(rec) {
    var tr = document.createElement("tr"), cells = [];
    ["num", "", "status", "num attempts", "started", "duration", "error"].forEach(function (cls) {
      var td = document.createElement("td");
      if (cls) td.className = cls;
      tr.append(td); cells.push(td);
    });
    cells[0].textContent = rec.ordinal;
    var a = document.createElement("a");
    a.href = stepUrl(rec.step_slug); a.textContent = rec.step_slug;
    cells[1].append(a);
    tr.dataset.step = rec.step_slug; tr.dataset.ordinal = rec.ordinal;
    var before = null;
    rows.forEach(function (other) {
      if (!before && +other.dataset.ordinal > rec.ordinal) before = other;
    });
    var bodies = document.querySelectorAll("#steps tbody");
    (before ? before.parentNode : bodies[bodies.length - 1]).insertBefore(tr, before);
    rows = new Map();
    document.querySelectorAll("#steps tbody tr").forEach(function (r) { rows.set(r.dataset.step, r); });
    var g = document.createElementNS(SVG, "g"), link = document.createElementNS(SVG, "a");
    var text = document.createElementNS(SVG, "text");
    g.setAttribute("class", "lane"); g.dataset.step = rec.step_slug;
    link.setAttribute("href", stepUrl(rec.step_slug));
    text.setAttribute("class", "label"); text.setAttribute("x", "4"); text.setAttribute("y", "13");
    text.setAttribute("clip-path", "url(#labels)"); text.textContent = rec.step_slug;
    link.append(text); g.append(link);
    var nextLane = before ? lanes.get(before.dataset.step) : null;
    var chunks = timeline.querySelectorAll("svg.lanes"), svg = nextLane ? nextLane.parentNode : chunks[chunks.length - 1];
    svg.insertBefore(g, nextLane);
    lanes.set(rec.step_slug, g);
    var y = 0;
    svg.querySelectorAll("g.lane").forEach(function (lane) {
      lane.setAttribute("transform", "translate(0 " + y + ")"); y += LANE;
    });
    svg.setAttribute("height", y + 4);
    svg.parentNode.style.containIntrinsicSize = "auto " + (y + 4) + "px";
    var empty = document.querySelector(".timeline-box .empty");
    if (empty) empty.remove();
    return tr;
  }

  function setBar(bar, attempt, status, code, start, end) {
    bar.setAttribute("class", "bar " + mark(status, code));
    bar.dataset.attempt = attempt;
    bar.dataset.start = start;
    bar.dataset.end = isNaN(end) ? "" : end;
    var title = bar.querySelector("title") || bar.appendChild(document.createElementNS(SVG, "title"));
    title.textContent = "attempt " + attempt + ": " + status + (code ? " (" + code + ")" : "");
    if (!isNaN(scaleFirst)) place(bar, Date.now());
  }

  // The lane shows every attempt; a record event carries the latest, so an older running bar
  // it overtakes becomes superseded, ended where the new attempt started.
  function drawLane(rec) {
    var g = lanes.get(rec.step_slug), start = ms(rec.started_at);
    if (rec.status === "pending" || isNaN(start)) return;
    var bars = g.querySelectorAll("rect.bar"), last = bars[bars.length - 1];
    if (last && +last.dataset.attempt === rec.attempt_count) {
      setBar(last, rec.attempt_count, rec.status, rec.error_code, start, ms(rec.completed_at));
      return;
    }
    if (last && !last.dataset.end) {
      setBar(last, +last.dataset.attempt, "superseded", null, +last.dataset.start, start);
    }
    var bar = document.createElementNS(SVG, "rect");
    setBar(bar, rec.attempt_count, rec.status, rec.error_code, start, ms(rec.completed_at));
    g.append(bar);
  }

  function apply(rec) {
    var tr = rows.get(rec.step_slug);
    if (tr && tr.dataset.updated === rec.updated_at) return;  // as rendered
    if (!tr) tr = newRow(rec);
    var cells = tr.cells;
    tr.dataset.status = rec.status; tr.dataset.updated = rec.updated_at;
    cells[2].replaceChildren(badge(rec.status, rec.error_code));
    cells[3].textContent = rec.attempt_count;
    cells[4].textContent = utc(ms(rec.started_at));
    var start = ms(rec.started_at), end = ms(rec.completed_at);
    cells[5].dataset.start = isNaN(start) ? "" : start;
    cells[5].dataset.end = isNaN(end) ? "" : end;
    cells[5].textContent = isNaN(start) ? "" : duration(((isNaN(end) ? Date.now() : end) - start) / 1000);
    cells[6].textContent = rec.error_code || "";
    drawLane(rec);
    counts();
  }

  var pending = false;
  function soon() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; layout(false); });
  }

  var live = document.getElementById("live");
  var source = new EventSource(main.dataset.stream);
  source.onopen = function () { live.textContent = "live"; live.className = "live on"; };
  source.onerror = function () {
    if (source.readyState !== EventSource.CLOSED) {
      live.textContent = "reconnecting…";
      live.className = "live";
      return;
    }
    // The stream was refused for good: the instance may have been deleted.
    fetch(location.href, { credentials: "same-origin" }).then(function (answer) {
      if (answer.status === 404) {
        live.textContent = "deleted: this instance no longer exists";
        live.className = "live gone";
        main.classList.add("gone");
      } else {
        live.textContent = "not live: reload the page";
        live.className = "live";
      }
    });
  };
  source.addEventListener("record", function (event) {
    var rec;
    try { rec = JSON.parse(event.data); } catch (e) { return; }
    if (!rec || typeof rec.step_slug !== "string") return;
    apply(rec);
    soon();
  });
  setInterval(tick, 1000);
})();
