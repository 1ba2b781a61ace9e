"""The page's texts, CSS and browser scripts (app.py lays out the widgets and wires these to them).

Kept apart from app.py so that it stays the page's layout and events; nothing here runs on the
server. HISTORY_KEY names the browser's localStorage entry of the history (docs/page.md, "History").
"""

from __future__ import annotations

import json

from sdxl_engine.service.styles import NO_STYLE

MODEL_NOTES = {  # shown under the banner for the built-in models
    "tiny-shapes": "Model `tiny-shapes`: a small demo model (SDXL architecture, 64×64, trained here on captioned "
                   "shapes: circle, square, triangle, star, cross, diamond; 8 colours; left/right/top/bottom/centre; "
                   "small/large; white/black/gray/blue backgrounds). ",
    "tiny-random": "Model `tiny-random`: the SDXL architecture with random weights (for tests): expect noise. ",
}
# Ends with the command (no full stop after it): on a phone the code wraps, and a stop would sit alone on a line.
REAL_SDXL_HINT = "For real SDXL, start it with: `python app.py --model stabilityai/stable-diffusion-xl-base-1.0`"
# At 1280x800 the 2x2 gallery is as wide as the window's height allows, so all four images show
# without scrolling; its box takes the grid's height (Gradio's own height, about half the window's,
# cut the second row off at 1280x1000 and above). Below 768 px the columns stack with the gallery first, right under the
# prompt; scroll anchoring is off there, or the browser scrolls the images away as it grows.
# There the prompt and Generate, and the resolution and seed, take a line each (side by side
# they squeeze the text). Toasts sit at the bottom left, off the Generate button (top right)
# and the gallery; on a phone, at the bottom. The history's tiles fill the width (no sideways
# scrolling); captions wrap instead of ending in "…", except the history's on a phone: three or four
# lines of a 137 px tile hid 40 % of the thumbnail, so there they are one small line, cut with "…"
# (a click restores the whole record). Stop shows only while a request of this page is queued or
# running (REQUEST_STARTS_JS / REQUEST_ENDS_JS mark the page): idle, a big red Stop has nothing to stop.
PAGE_CSS = """
#gallery .grid-container { max-width: max(240px, min(100%, calc(100vh - 380px))); margin-inline: auto; }
#gallery, #gallery .grid-wrap { height: auto !important; max-height: none !important; }
@media (max-width: 767px) { #output-col { order: -1; } #main-row { overflow-anchor: none; }
  #prompt-row, #size-row, #size-row .form { flex-wrap: wrap; }
  #prompt-row > *, #size-row > *, #size-row .form > * { flex: 1 1 100% !important; } }
.toast-wrap { top: auto !important; bottom: var(--size-3) !important; left: var(--size-3) !important;
  right: auto !important; align-items: start !important; }
@media (max-width: 767px) { .toast-wrap { right: var(--size-3) !important; width: auto !important; } }
#history .grid-container { grid-template-columns: repeat(auto-fill, minmax(120px, 1fr)) !important; }
#history .caption-label, #gallery .caption-label { white-space: normal !important; overflow: visible !important;
  text-overflow: clip !important;
  max-width: calc(100% - 8px) !important; line-height: 1.2; }
@media (max-width: 767px) { #history .caption-label { white-space: nowrap !important; overflow: hidden !important;
  text-overflow: ellipsis !important; font-size: 10px !important; padding: 1px 4px !important; } }
body:not([data-requests]) #stop, body[data-requests="0"] #stop { display: none !important; }
"""
HISTORY_KEY = "sdxl-jax-history"  # the BrowserState's localStorage key
HISTORY_NOTE = "Click an image to restore its prompt, style, seed and settings."
# Shown in place of the history note when the history this browser kept cannot be read (see HISTORY_JS).
HISTORY_LOST_NOTE = ("This browser's earlier history cannot be read: the server's history key changed since it "
                     "was saved (docs/page.md, \"History\"). New generations start a new history.")
# The history gallery, drawn in the browser from the records' JPEG data URLs (the server writes no
# thumbnail), in history.entry's order. A history this browser kept but cannot read now (the history
# key changed: docs/page.md, "History") comes back empty; a count kept beside it tells that case apart.
HISTORY_JS = f"""(past) => {{ const records = Array.isArray(past) ? past : [];
  const items = [];
  for (const r of records) {{
    if (!r || !Array.isArray(r.seeds) || !Array.isArray(r.thumbs)) continue;
    const style = r.style && r.style !== {json.dumps(NO_STYLE)} ? ` · ${{r.style}}` : '';
    r.seeds.forEach((seed, i) => {{ const url = r.thumbs[i];
      if (typeof url !== 'string' || !url.startsWith('data:image/jpeg;base64,')) return;
      items.push({{image: {{url: url, orig_name: `seed${{seed}}.jpg`, mime_type: 'image/jpeg'}},
                  caption: `seed ${{seed}}${{style}} · ${{String(r.prompt).slice(0, 40)}}`}});
    }});
  }}
  const countKey = {json.dumps(HISTORY_KEY)} + '-count', kept = Number(localStorage.getItem(countKey) || 0);
  const lost = records.length === 0 && kept > 0 && localStorage.getItem({json.dumps(HISTORY_KEY)}) !== null;
  if (!lost) localStorage.setItem(countKey, String(records.length));
  document.querySelector('#history')?.setAttribute('data-drawn', String(Date.now()));  /* when it was drawn last */
  return [items, lost ? {json.dumps(HISTORY_LOST_NOTE)} : {json.dumps(HISTORY_NOTE)}]; }}"""
# An emptied history is not an unreadable one: the count beside it goes to 0 first. (The one output's
# value is wrapped in a list: Gradio reads an array returned by a page script as the list of outputs.)
CLEAR_HISTORY_JS = f"() => {{ localStorage.setItem({json.dumps(HISTORY_KEY + '-count')}, '0'); return [[]]; }}"
PARSE_SIZE_JS = "(v) => String(v || '0x0').split('x').map(Number)"  # "WxH" (a size_choices value) -> [width, height]
SCROLL_TO_GALLERY_JS = """() => { if (window.innerWidth < 768) {  /* after the page's own updates settle */
  setTimeout(() => document.querySelector('#gallery')?.scrollIntoView({block: 'start'}), 100); } }"""
# At Stop: what the page last showed of its running request, for app.stopped_view: "k/N" (the step of the
# preview's caption or of the progress line, whichever is later), "waiting" (its progress line shows no step
# yet), "" (no request running).
STOP_STEP_JS = """() => { const gallery = document.querySelector('#gallery');
  const caption = gallery?.querySelector('.caption-label')?.innerText.trim() || '';
  const tracker = gallery?.querySelector('[data-testid="status-tracker"]');
  const progress = tracker?.innerText.trim() || '';
  let best = null;
  for (const text of [caption.startsWith('preview') ? caption : '', progress]) {
    const m = /step (\\d+)\\/(\\d+)/.exec(text);
    if (m && (!best || Number(m[1]) > best[0])) best = [Number(m[1]), Number(m[2])];
  }
  return best ? `${best[0]}/${best[1]}` : progress ? 'waiting' : ''; }"""
# At each start and end (success, error or Stop) of a request of this page: the count of its requests queued or
# running, on the page's body, where PAGE_CSS reads it (Stop shows while it is above 0). On the body, not the
# button: Gradio owns the button's attributes.
REQUEST_STARTS_JS = ("() => { document.body.dataset.requests = "
                     "String(Number(document.body.dataset.requests || 0) + 1); }")
REQUEST_ENDS_JS = ("() => { document.body.dataset.requests = "
                   "String(Math.max(0, Number(document.body.dataset.requests || 0) - 1)); }")
# At Generate: a Stop's line goes (it described the stopped request; a finished one's line stays until the
# new one's), and no Stop is heard yet.
NEW_REQUEST_JS = "(s) => [(typeof s === 'string' && s.startsWith('**Stopped')) ? '' : s, '']"
# Restore settings from a PNG (app.png_settings): a file input and a drop zone; the PNG is read here in the
# browser, never uploaded (the server takes no files): only its `parameters` text goes to the page's event.
PNG_SETTINGS_HTML = """<div class="png-drop" style="border: 1px dashed var(--border-color-primary); border-radius: 8px;
  padding: 12px; text-align: center;">
  <label>Drop a PNG here, or choose one: \
<input type="file" accept="image/png" aria-label="PNG to restore settings from"></label>
</div>"""
# Its js_on_load (gr.HTML: `element`, `props`, `trigger`). The text of the first tEXt, iTXt or zTXt chunk
# keyed `parameters` (PNG spec 11.3.4; A1111 and this server write tEXt, or iTXt for non-Latin-1 text),
# '' when there is none or the file is no PNG; capped, as a parameters text is a few kB.
PNG_SETTINGS_JS = """
const MAX = 60000, input = element.querySelector('input[type=file]'), zone = element.querySelector('.png-drop');
const inflate = async (bytes) => new Response(new Blob([bytes]).stream()
  .pipeThrough(new DecompressionStream('deflate'))).arrayBuffer().then(b => new Uint8Array(b));
async function parameters(bytes) {
  const sig = [137, 80, 78, 71, 13, 10, 26, 10], view = new DataView(bytes.buffer);
  if (bytes.length < 8 || sig.some((b, i) => bytes[i] !== b)) return '';
  for (let at = 8; at + 12 <= bytes.length;) {
    const length = view.getUint32(at), type = String.fromCharCode(...bytes.subarray(at + 4, at + 8));
    const data = bytes.subarray(at + 8, Math.min(at + 8 + length, bytes.length));
    at += 12 + length;
    if (type === 'IEND') break;
    if (!['tEXt', 'iTXt', 'zTXt'].includes(type)) continue;
    const nul = data.indexOf(0);
    if (nul < 0 || new TextDecoder('latin1').decode(data.subarray(0, nul)) !== 'parameters') continue;
    if (type === 'tEXt') return new TextDecoder('latin1').decode(data.subarray(nul + 1));
    if (type === 'zTXt') return new TextDecoder('latin1').decode(await inflate(data.subarray(nul + 2)));
    const compressed = data[nul + 1] === 1;  /* iTXt: flag, method, language\\0, translated keyword\\0, text */
    let rest = nul + 3;
    rest = data.indexOf(0, rest) + 1; rest = data.indexOf(0, rest) + 1;
    if (rest <= 0) return '';
    const text = compressed ? await inflate(data.subarray(rest)) : data.subarray(rest);
    return new TextDecoder('utf-8').decode(text);
  }
  return '';
}
async function read(file) {
  let text = '';
  try { text = (await parameters(new Uint8Array(await file.arrayBuffer()))).slice(0, MAX); } catch (err) { text = ''; }
  props.value = text || ' ';  /* a blank: no parameters found (the event says so) */
  trigger('input');
}
input.addEventListener('change', () => { const file = input.files[0]; input.value = ''; if (file) read(file); });
zone.addEventListener('dragover', (e) => e.preventDefault());
zone.addEventListener('drop', (e) => { e.preventDefault(); const file = e.dataTransfer.files[0]; \
if (file) read(file); });
"""
# The image to image picture's check, in the browser (a gr.HTML's js_on_load beside the editor): the editor keeps a
# dropped or chosen file in the page and sends it only with Generate from image, and a file that is no picture
# left it empty without a word until then. Each file it takes is read here by its first bytes, as the server's
# upload check reads them (guard: PNG, JPEG or WebP, whatever its name): another is named at once in this
# element; a picture clears it.
PICTURE_CHECK_JS = """
const box = document.querySelector('#init-image');
const say = (text) => { element.querySelector('.picture-error').textContent = text; };
async function check(file) {
  if (!file) return;
  const b = new Uint8Array(await file.slice(0, 12).arrayBuffer());
  const is = (at, bytes) => bytes.every((v, i) => b[at + i] === v);
  const picture = is(0, [137, 80, 78, 71, 13, 10, 26, 10]) || is(0, [255, 216, 255])
    || (is(0, [82, 73, 70, 70]) && is(8, [87, 69, 66, 80]));
  say(picture ? '' : `${file.name.slice(0, 80)}: not a PNG, JPEG or WebP picture; the editor cannot take it.`);
}
box?.addEventListener('change', (e) => { if (e.target.matches?.('input[type=file]')) check(e.target.files?.[0]); },
  true);
box?.addEventListener('drop', (e) => check(e.dataTransfer?.files?.[0]), true);
"""
PICTURE_CHECK_HTML = '<div class="picture-error" role="alert" style="color: var(--error-text-color);"></div>'
