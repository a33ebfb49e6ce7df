// A small Markdown renderer for model replies: fenced code blocks (an unclosed fence while streaming is code to
// the end), headings, lists (nested by indentation), block quotes, tables, rules, paragraphs; inline code, bold,
// italic, strikethrough, links (http, https, mailto only). Every piece of text is HTML-escaped before any markup
// is added, so a reply can never inject HTML.

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export function escapeHtml(s) { return String(s).replace(/[&<>"']/g, (c) => ESC[c]); }

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function inline(text) {
  const codes = [];
  let s = escapeHtml(text.replace(/\u0000/g, ""));
  s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => {
    codes.push(`<code>${code.trim() === "" ? code : code.replace(/^ (.*) $/, "$1")}</code>`);
    return `\u0000${codes.length - 1}\u0000`;
  });
  s = s.replace(/\[([^\]]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g,
                (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
  s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>");
  s = s.replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
}

function codeBlock(lang, lines) {
  const label = lang ? escapeHtml(lang) : "code";
  return `<div class="code"><div class="code-head"><span>${label}</span>` +
         `<button type="button" class="copy-code">Copy</button></div>` +
         `<pre><code${lang ? ` class="language-${escapeHtml(lang)}"` : ""}>${escapeHtml(lines.join("\n"))}</code></pre></div>`;
}

function cells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines) {
  const head = cells(lines[0]);
  const rows = lines.slice(2).map(cells);
  const th = head.map((c) => `<th>${inline(c)}</th>`).join("");
  const tr = rows.map((r) => `<tr>${head.map((_, i) => `<td>${inline(r[i] || "")}</td>`).join("")}</tr>`).join("");
  return `<table><thead><tr>${th}</tr></thead><tbody>${tr}</tbody></table>`;
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line) ||
         (line.includes("|") && next !== undefined && TABLE_SEP.test(next) && next.includes("-"));
}

function indentOf(line) { return line.match(/^\s*/)[0].replace(/\t/g, "    ").length; }

function list(lines, i) {
  const first = lines[i].match(ITEM);
  const base = indentOf(lines[i]);
  const ordered = /\d/.test(first[2]);
  const items = [];
  let cur = null;
  for (; i < lines.length; i++) {
    const line = lines[i];
    const m = line.match(ITEM);
    if (m && indentOf(line) === base && /\d/.test(m[2]) === ordered) {
      cur = [m[3]];
      items.push(cur);
      continue;
    }
    if (line.trim() === "") {
      const next = lines[i + 1];
      if (next !== undefined && next.trim() !== "" && indentOf(next) > base) { cur.push(""); continue; }
      break;
    }
    if (indentOf(line) > base) { cur.push(line.replace(new RegExp(`^\\s{0,${base + 4}}`), "")); continue; }
    if (!startsBlock(line, lines[i + 1]) && cur.length && cur[cur.length - 1].trim() !== "") {
      cur.push(line.trim());  // a lazy continuation line of the item's paragraph
      continue;
    }
    break;
  }
  const tag = ordered ? "ol" : "ul";
  const start = ordered && parseInt(first[2], 10) !== 1 ? ` start="${parseInt(first[2], 10)}"` : "";
  const html = `<${tag}${start}>${items.map((it) => `<li>${blocks(it)}</li>`).join("")}</${tag}>`;
  return [html, i];
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const fence = m[1];
      const body = [];
      for (i++; i < lines.length; i++) {
        const close = lines[i].trim();
        if (close.startsWith(fence) && close.replace(new RegExp(`^\\${fence[0]}+`), "") === "") { i++; break; }
        body.push(lines[i]);
      }
      out.push(codeBlock(m[2], body));
    } else if (line.trim() === "") {
      i++;
    } else if ((m = line.match(HEADING))) {
      const n = m[1].length;
      out.push(`<h${n}>${inline(m[2])}</h${n}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
      out.push(`<blockquote>${blocks(body)}</blockquote>`);
    } else if (ITEM.test(line)) {
      const [html, next] = list(lines, i);
      out.push(html);
      i = next;
    } else if (line.includes("|") && TABLE_SEP.test(lines[i + 1] || "") && (lines[i + 1] || "").includes("-")) {
      const rows = [line, lines[i + 1]];
      for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim() !== ""; i++) rows.push(lines[i]);
      out.push(table(rows));
    } else {
      const para = [line.trim()];
      for (i++; i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i], lines[i + 1]); i++) {
        para.push(lines[i].trim());
      }
      out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    }
  }
  return out.join("");
}

/** `text` (Markdown) as HTML; safe to assign to innerHTML. */
export function renderMarkdown(text) {
  return blocks(String(text || "").replace(/\r\n?/g, "\n").split("\n"));
}
