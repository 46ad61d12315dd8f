// pgleaderlock dashboard: draws the snapshot the server sends (server-sent events) and
// redraws it when it changes. Every string from the database is shown with textContent
// (never innerHTML), its control characters made visible: the participants and runs
// tables hold other roles' text.
"use strict";

(function () {
  const OUTCOMES = ["done", "failed", "lost", "missed", "running", "sent", "executed"];

  // Control characters (C0, DEL, C1) and bidirectional overrides as \xNN / \uNNNN.
  function shown(value) {
    if (value === null || value === undefined) return "";
    const text = typeof value === "string" ? value : JSON.stringify(value);
    return text.replace(/[\u0000-\u001f\u007f-\u009f\u200e\u200f\u202a-\u202e\u2066-\u2069]/g,
      (c) => {
        const code = c.charCodeAt(0);
        return code < 256 ? "\\x" + code.toString(16).padStart(2, "0")
          : "\\u" + code.toString(16).padStart(4, "0");
      });
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = shown(text);
    return node;
  }

  function tag(text, cls) {
    return el("span", "tag " + (cls || ""), text);
  }

  function when(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    return isNaN(d) ? String(iso) : d.toLocaleString();
  }

  function table(headers, rows) {
    const t = el("table");
    const head = el("tr");
    for (const h of headers) head.appendChild(el("th", null, h));
    t.appendChild(head);
    for (const cells of rows) {
      const tr = el("tr");
      for (const cell of cells) {
        const td = el("td");
        if (cell instanceof Node) td.appendChild(cell); else td.textContent = shown(cell);
        tr.appendChild(td);
      }
      t.appendChild(tr);
    }
    return t;
  }

  function who(session) {
    const span = el("span");
    span.appendChild(el("span", "who", session.identity || session.application_name || "pid " + session.pid));
    if (session.impostor) span.appendChild(tag("impostor", "impostor"));
    else if (session.trusted === false) span.appendChild(tag("untrusted role", "untrusted"));
    return span;
  }

  function drawLock(lock) {
    const card = el("div", "card lock");
    card.setAttribute("data-lock", lock.lock.name);
    const h = el("h3", null, lock.lock.name);
    h.appendChild(el("span", "muted mono", "  " + lock.lock.key1 + "," + lock.lock.key2));
    card.appendChild(h);
    const leader = lock.leader;
    const line = el("p");
    if (leader) {
      line.appendChild(document.createTextNode("leader: "));
      const name = el("span", "leader", leader.identity || leader.application_name || "pid " + leader.pid);
      name.setAttribute("data-role", "leader");
      line.appendChild(name);
      if (leader.impostor) line.appendChild(tag("impostor", "impostor"));
      else if (!leader.trusted) line.appendChild(tag("untrusted role", "untrusted"));
      const facts = [" role " + (leader.usename || "?"), "pid " + leader.pid];
      if (leader.since) facts.push("since " + when(leader.since));
      if (leader.term !== null && leader.term !== undefined) facts.push("term " + leader.term);
      line.appendChild(el("span", "muted", " · " + facts.join(" · ")));
    } else {
      line.appendChild(el("span", "nobody", "nobody leads"));
    }
    card.appendChild(line);
    if (leader && leader.metadata) card.appendChild(el("p", "mono", "metadata: " + JSON.stringify(leader.metadata)));
    const rows = [];
    for (const s of lock.waiting || []) {
      rows.push([who(s), s.usename, s.pid, s.priority === null || s.priority === undefined ? "" : s.priority,
        s.wait_start_age_s === null ? "" : s.wait_start_age_s.toFixed(1) + " s"]);
    }
    if (rows.length) {
      card.appendChild(el("p", "muted", "waiting (" + rows.length + ")"));
      card.appendChild(table(["identity", "role", "pid", "priority", "waiting for"], rows));
    }
    const observers = lock.observers || [];
    if (observers.length) {
      card.appendChild(el("p", "muted", "observers (" + observers.length + ")"));
      card.appendChild(table(["identity", "role", "pid"], observers.map((o) => [who(o), o.usename, o.pid])));
    }
    const untrusted = lock.untrusted_rows || [];
    if (untrusted.length) {
      card.appendChild(el("p", "muted", "rows of roles not trusted (never followed)"));
      card.appendChild(table(["identity", "role", "pid"], untrusted.map((o) => {
        const span = el("span", "untrusted-row", o.identity);
        span.appendChild(tag("untrusted role", "untrusted"));
        return [span, o.usename, o.pid];
      })));
    }
    const table_ = lock.participants_table;
    if (table_ && table_.not_read) card.appendChild(el("p", "muted", table_.table + " not read: " + table_.not_read));
    const history = lock.history || [];
    if (history.length) {
      const list = el("ol", "history");
      list.setAttribute("reversed", "");
      for (const change of history) {
        const l = change.leader;
        const text = when(change.at) + (change.first_seen ? " (first seen) " : " ") + "→ " +
          (l ? (l.identity || "pid " + l.pid) + (l.term !== null && l.term !== undefined ? " term " + l.term : "") : "nobody");
        list.appendChild(el("li", null, text));
      }
      const details = el("details");
      details.appendChild(el("summary", "muted", "leadership seen (" + history.length + ")"));
      details.appendChild(list);
      card.appendChild(details);
    }
    return card;
  }

  function drawGroup(group) {
    const card = el("div", "card group");
    card.setAttribute("data-group", group.group);
    const h = el("h3", null, group.group);
    const b = group.balance;
    h.appendChild(tag(b.balanced ? "balanced" : "spread " + b.spread, b.balanced ? "balanced" : "unbalanced"));
    card.appendChild(h);
    const rows = group.members.map((m) => {
      const names = (group.names_by_member[m.member] || []).join(", ");
      return [m.member, m.mode || "", m.names, el("span", "names", names)];
    });
    card.appendChild(table(["member", "sessions", "names", "leads"], rows));
    const free = group.leaders.filter((l) => !l.member);
    if (free.length) {
      card.appendChild(el("p", "muted", "names led outside the group or by nobody: " +
        free.map((l) => l.name || l.key1 + "," + l.key2).join(", ")));
    }
    if (group.impostors.length) card.appendChild(el("p", null, group.impostors.length + " impostor session(s)"));
    return card;
  }

  function drawSemaphore(sem) {
    const card = el("div", "card semaphore");
    card.setAttribute("data-semaphore", sem.name);
    card.appendChild(el("h3", null, sem.name));
    card.appendChild(el("p", "muted", sem.held + " slot(s) held; " + sem.followers.length + " follower session(s)"));
    card.appendChild(table(["slot", "holder", "role", "pid", "waiting"], sem.slots.map((s) => [
      s.slot, s.holder ? who(s.holder) : el("span", "nobody", "free"), s.holder ? s.holder.usename : "",
      s.holder ? s.holder.pid : "", s.waiting.length])));
    return card;
  }

  function drawSchedules(report) {
    const box = el("div");
    if (report.not_read) box.appendChild(el("p", "muted", report.table + " not read: " + report.not_read));
    if (report.absent) box.appendChild(el("p", "empty", "no schedule has run yet (" + report.absent + ")"));
    const legend = el("div", "legend");
    for (const o of OUTCOMES) {
      const item = el("span");
      item.appendChild(el("span", "slot outcome-" + o));
      item.appendChild(document.createTextNode(o));
      legend.appendChild(item);
    }
    if (report.items.length) box.appendChild(legend);
    for (const item of report.items) {
      const card = el("div", "card schedule");
      card.setAttribute("data-schedule", item.schedule);
      card.appendChild(el("h3", null, item.schedule));
      card.appendChild(el("p", "muted", (item.spec || "") + " · next slot " + when(item.next_slot)));
      const line = el("div", "timeline");
      for (const run of item.last_runs.slice().reverse()) {
        const square = el("span", "slot outcome-" + (OUTCOMES.includes(run.outcome) ? run.outcome : "other"));
        square.setAttribute("title", shown(when(run.slot) + " " + run.outcome + (run.holder ? " by " + run.holder : "") +
          (run.detail ? ": " + run.detail : "")));
        square.setAttribute("data-outcome", shown(run.outcome));
        line.appendChild(square);
      }
      card.appendChild(line);
      card.appendChild(table(["slot", "outcome", "holder", "term", "detail"], item.last_runs.slice(0, 5).map((r) =>
        [when(r.slot), r.outcome, r.holder, r.term, r.detail])));
      box.appendChild(card);
    }
    return box;
  }

  function fill(id, nodes, empty) {
    const box = document.getElementById(id);
    box.replaceChildren();
    const grid = el("div", "cards");
    for (const n of nodes) grid.appendChild(n);
    box.appendChild(nodes.length ? grid : el("p", "empty", empty));
  }

  function draw(snapshot) {
    if (!snapshot) return;
    document.getElementById("where").textContent = shown("database " + snapshot.database + " · read as " +
      snapshot.user + (snapshot.trust.trusted_roles.length ? " · trusting " + snapshot.trust.trusted_roles.join(", ") : "") +
      " · history since " + when(snapshot.history_since));
    fill("locks", snapshot.locks.map(drawLock), "no named lock is held or awaited");
    if (snapshot.locks_left_out) document.getElementById("locks").appendChild(el("p", "muted", snapshot.locks_left_out + " more not shown"));
    fill("groups", snapshot.groups.map(drawGroup), "no Coordinator group is running");
    fill("semaphores", snapshot.semaphores.map(drawSemaphore), "no semaphore slot is held");
    const schedules = document.getElementById("schedules");
    schedules.replaceChildren(drawSchedules(snapshot.schedules));
    fill("others", snapshot.other_locks.length ? [table(["keys", "holder", "role", "pid", "granted"],
      snapshot.other_locks.map((o) => [o.kind === "bigint" ? String(o.key) : o.key1 + "," + o.key2, who(o), o.usename, o.pid,
        o.granted ? "held" : "waiting"]))] : [], "none");
    fill("impostors", snapshot.impostors.length ? [table(["application_name", "role", "pid"],
      snapshot.impostors.map((s) => [el("span", "impostor-name", s.application_name), s.usename, s.pid]))] : [], "none");
  }

  function tick(t) {
    const live = document.getElementById("live");
    live.setAttribute("data-state", t.error ? "error" : "live");
    live.setAttribute("data-seq", String(t.seq));
    live.textContent = shown((t.error ? "stale" : "live") + " · " + (t.listening ? "notified by the leader channel, " : "") +
      "refreshed every " + t.period_s + " s at most · " + when(t.at));
    const error = document.getElementById("error");
    error.hidden = !t.error;
    error.textContent = shown(t.error ? "the last refresh failed: " + t.error : "");
    document.getElementById("cost").textContent = shown("One refresher for every page: " + t.refreshes + " refreshes, " +
      t.statements + " statements so far, " + t.clients + " page(s) open; last refresh " + t.refresh_ms + " ms.");
  }

  function connect() {
    const source = new EventSource("api/events");
    source.addEventListener("snapshot", (e) => draw(JSON.parse(e.data)));
    source.addEventListener("tick", (e) => tick(JSON.parse(e.data)));
    source.onerror = () => {
      const live = document.getElementById("live");
      live.setAttribute("data-state", "error");
      live.textContent = "disconnected, reconnecting…";
    };
  }

  connect();
})();
