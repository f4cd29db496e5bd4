// Reference token ids and chat renderings for hftokenizer's tests.
//
// usage: node oracle.mjs MODEL_DIR CORPUS_JSON MTBENCH_JSONL SONNET_TXT > vectors.json
//
// MODEL_DIR holds tokenizer.json and tokenizer_config.json. The tokenizer is
// @lenml/tokenizers (a dependency-free fork of transformers.js's tokenizers),
// the chat templates are rendered with @huggingface/jinja, as transformers'
// apply_chat_template renders them: the template gets messages, tools,
// add_generation_prompt, the special tokens named in tokenizer_config.json
// and any extra keyword arguments; the rendering is then tokenized without
// added special tokens (transformers: tokenizer(rendered,
// add_special_tokens=False); vLLM does the same for chat prompts).
//
// Multi-part content is flattened before rendering as vLLM does for templates
// that take content as a string (vllm/entrypoints/chat_utils.py,
// _parse_chat_message_content_parts: text parts joined with "\n").
import fs from "node:fs";
import path from "node:path";
import { TokenizerLoader } from "@lenml/tokenizers";
import { Template } from "@huggingface/jinja";

const [modelDir, corpusPath, mtbenchPath, sonnetPath] = process.argv.slice(2);
const tokenizerJSON = JSON.parse(fs.readFileSync(path.join(modelDir, "tokenizer.json"), "utf8"));
const tokenizerConfig = JSON.parse(fs.readFileSync(path.join(modelDir, "tokenizer_config.json"), "utf8"));
const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));

const texts = corpus.texts.map((t) => ({ ...t }));
const chats = corpus.chats.map((c) => ({ part: "chat", ...c }));

// MT-bench: every turn as a text, every question as a two-turn chat.
const fixedAnswer = "Sure, here is my answer.\n\n1. First point.\n2. Second point.";
for (const line of fs.readFileSync(mtbenchPath, "utf8").split("\n")) {
  if (!line.trim()) continue;
  const q = JSON.parse(line);
  q.turns.forEach((turn, i) => texts.push({ part: "mtbench", name: `q${q.question_id}-t${i + 1}`, text: turn }));
  const messages = [{ role: "user", content: q.turns[0] }];
  for (const turn of q.turns.slice(1)) {
    messages.push({ role: "assistant", content: fixedAnswer }, { role: "user", content: turn });
  }
  chats.push({ part: "mtbench", name: `q${q.question_id}`, messages, add_generation_prompt: true });
}

// The sonnet: the whole text, and each run of 14 lines.
const sonnet = fs.readFileSync(sonnetPath, "utf8");
texts.push({ part: "sonnet", name: "whole", text: sonnet });
const lines = sonnet.split("\n");
for (let i = 0; i < lines.length; i += 14) {
  texts.push({ part: "sonnet", name: `lines-${i}`, text: lines.slice(i, i + 14).join("\n") });
}

for (const t of texts) {
  t.ids = tok.encode(t.text, { add_special_tokens: false });
  t.ids_special = tok.encode(t.text, { add_special_tokens: true });
  // The tokenizer's own decoding, without transformers' English-specific
  // clean_up_tokenization_spaces (" ," -> ","), which is not the tokenizer's.
  t.decoded = tok.decode(t.ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
}

function flatten(messages) {
  return messages.map((m) => {
    if (!Array.isArray(m.content)) return m;
    const text = m.content.filter((p) => p.type === "text").map((p) => p.text).join("\n");
    return { ...m, content: text };
  });
}

function tokenString(v) {
  if (v == null) return v;
  return typeof v === "string" ? v : v.content;
}

// A model without a chat template (GPT-4o's files) has text vectors only.
const template = tokenizerConfig.chat_template ? new Template(tokenizerConfig.chat_template) : null;
for (const c of template ? chats : []) {
  const ctx = {
    messages: flatten(c.messages),
    add_generation_prompt: !!c.add_generation_prompt,
    ...c.extra,
  };
  if (c.tools) ctx.tools = c.tools;
  for (const k of ["bos_token", "eos_token", "unk_token", "pad_token"]) {
    const v = tokenString(tokenizerConfig[k]);
    if (v != null) ctx[k] = v;
  }
  try {
    c.rendered = template.render(ctx);
    c.ids = tok.encode(c.rendered, { add_special_tokens: false });
  } catch (e) {
    c.error = String(e && e.message ? e.message : e);
  }
}

process.stdout.write(JSON.stringify({
  oracle: { tokenizers: "@lenml/tokenizers", jinja: "@huggingface/jinja" },
  texts,
  chats: template ? chats : [],
}));
