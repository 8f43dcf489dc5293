// The Vercel AI SDK against a live server: the default `@ai-sdk/openai` provider (`openai(model)`: the
// Responses API), plain and streamed, and `toolChoice: 'required'` on the chat provider and the default one.
// Run from a folder where `ai`, `@ai-sdk/openai` and `zod` are installed:
//   node compat/vercel_check.mjs BASE_URL MODEL
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, streamText, tool } from 'ai';
import { z } from 'zod';

const [baseURL, model] = process.argv.slice(2);
const openai = createOpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'unused' });
const check = (ok, what) => { if (!ok) { throw new Error(`failed: ${what}`); } };

const plain = await generateText({ model: openai(model), prompt: 'Name three primary colours.', maxOutputTokens: 40, temperature: 0 });
check(plain.text.length > 0, 'default provider text');
console.log('default provider (responses):', JSON.stringify(plain.text.slice(0, 60)), plain.usage.outputTokens, 'tokens');

const streamed = streamText({ model: openai(model), prompt: 'Name three primary colours.', maxOutputTokens: 40, temperature: 0 });
let text = '';
for await (const piece of streamed.textStream) { text += piece; }
check(text === plain.text, `streamed text equals the plain text: ${JSON.stringify(text)} vs ${JSON.stringify(plain.text)}`);
console.log('default provider streamed: same text');

for (const [name, m] of [['chat', openai.chat(model)], ['responses', openai(model)]]) {
  const runs = [];
  const weather = tool({
    description: 'The current weather in a city',
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => { runs.push(city); return `18 C and sunny in ${city}`; },
  });
  const result = await generateText({
    model: m, prompt: 'What is the weather in Paris?', tools: { weather }, toolChoice: 'required',
    maxOutputTokens: 120, temperature: 0,
  });
  check(result.toolCalls.length >= 1 && runs.length === result.toolCalls.length, `${name}: the tool ran`);
  const distinct = new Set(result.toolCalls.map((c) => JSON.stringify(c.input)));
  check(distinct.size === result.toolCalls.length, `${name}: no repeated call`);
  console.log(`toolChoice required (${name}):`, result.toolCalls.map((c) => c.input), 'ran', runs, result.finishReason);
}
